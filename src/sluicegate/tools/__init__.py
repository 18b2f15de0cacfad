"""Tool calling on the embedded engines: what a request's ``tools`` and ``tool_choice``
ask for (:mod:`.spec`), how tools, calls and their results are written into the prompt
(:mod:`.prompt`), the grammar that holds the model to well-formed calls
(:mod:`.grammar`, over the bounded JSON schemas of :mod:`.schema`), and the parser that
turns the generated text back into OpenAI's tool-call deltas (:mod:`.parser`).  The sim
engine, which follows no grammar, is given a scripted answer in the same format
(:mod:`.sim_answer`, with schema instances from :mod:`.example`).

The call syntax itself lives in :mod:`.syntax`; README.md's "Tool calling" section
describes it for users.  Nothing here applies in front of upstream engines, which do
their own tools.
"""
