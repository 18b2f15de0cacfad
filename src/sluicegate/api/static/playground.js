// The playground: one streamed chat completion at a time, with Stop, TTFT and tokens/s.

import { ApiError, authHeaders, errorFromEvent, errorFromResponse, sseData } from "./api.js";

const $ = (id) => document.getElementById(id);

export function initPlayground({ onModel }) {
  const root = $("playground");
  const form = $("prompt-form");
  const prompt = $("prompt");
  const send = $("send");
  const stop = $("stop");
  const output = $("output");
  const errorBox = $("error");
  const status = $("status");
  const model = $("model");
  const temperature = $("temperature");
  let controller = null; // the AbortController of the answer being streamed, if any
  let current = null; // { id, resumeToken } of that answer, once its headers arrived

  const jsonMode = $("json-mode");
  jsonMode.addEventListener("change", () => {
    $("schema-label").hidden = !jsonMode.checked;
  });
  let pipelines = {}; // pipeline name -> its description from /v1/models
  model.addEventListener("change", showPipeline);

  function showPipeline() {
    const info = $("pipeline-info");
    const pipeline = pipelines[model.value];
    info.hidden = !pipeline;
    if (!pipeline) return;
    const steps = [pipeline.retrieval ? "retrieve" : null, "generate", ...pipeline.stages];
    info.textContent = `Pipeline: ${steps.filter(Boolean).join(" → ")}`;
  }

  temperature.addEventListener("input", () => {
    $("temperature-value").value = Number(temperature.value).toFixed(2);
  });
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    ask();
  });
  // While the user types, warm the server's prefix cache with what is typed so far
  // (POST /v1/prefill, debounced): the final request then computes only the rest.
  let warmTimer = null;
  const warmSoon = () => {
    clearTimeout(warmTimer);
    warmTimer = setTimeout(warm, 400);
  };
  prompt.addEventListener("input", warmSoon);
  $("system").addEventListener("input", warmSoon);

  function warm() {
    if (controller || !prompt.value.trim() || !model.value) return;
    const messages = conversation();
    fetch("/v1/prefill", {
      method: "POST",
      headers: authHeaders({ "content-type": "application/json" }),
      body: JSON.stringify({ model: model.value, messages, user: "playground" }),
    })
      .then((response) => {
        if (response.ok) root.dataset.warmed = String(Number(root.dataset.warmed || 0) + 1);
      })
      .catch(() => {}); // only a warm-up: the question is sent in full anyway
  }

  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      ask();
    }
  });
  // Stop cancels the generation on the server at once, then closes the connection.
  // (Closing alone would leave a resumable stream running for its detach grace.)
  stop.addEventListener("click", () => {
    if (current?.id) cancelOnServer(current);
    controller?.abort();
  });

  function cancelOnServer({ id, resumeToken }) {
    // Its owner's key (auth on) or its resume token (open mode) authorises the cancel.
    const headers = authHeaders(resumeToken ? { "x-sluicegate-resume-token": resumeToken } : {});
    fetch(`/v1/requests/${encodeURIComponent(id)}/cancel`, { method: "POST", headers })
      .catch(() => {}); // the connection closes anyway, and the server cancels after its grace
  }

  function setState(state, text = "") {
    root.dataset.state = state; // idle | waiting | streaming | done | stopped | error
    status.textContent = text;
    const busy = state === "waiting" || state === "streaming";
    send.disabled = busy;
    stop.disabled = !busy;
  }

  function showError(message) {
    errorBox.textContent = message;
    errorBox.hidden = !message;
  }

  async function loadModels() {
    try {
      const response = await fetch("/v1/models", { headers: authHeaders() });
      if (!response.ok) throw await errorFromResponse(response);
      // Chat models and pipelines only: an embedding model (task "embed") cannot answer.
      const data = (await response.json()).data.filter((m) => m.task !== "embed");
      const ids = data.map((m) => m.id);
      pipelines = Object.fromEntries(data.filter((m) => m.pipeline).map((m) => [m.id, m.pipeline]));
      const previous = model.value;
      const group = (label, entries) => {
        const element = document.createElement("optgroup");
        element.label = label;
        element.append(...entries.map((m) => new Option(m.id, m.id)));
        return element;
      };
      const plain = data.filter((m) => !m.pipeline);
      const piped = data.filter((m) => m.pipeline);
      model.replaceChildren(
        ...(piped.length ? [group("Models", plain), group("Pipelines", piped)]
          : plain.map((m) => new Option(m.id, m.id))),
      );
      if (ids.includes(previous)) model.value = previous;
      showPipeline();
      onModel(plain[0]?.id ?? null, null);
      if (errorBox.dataset.source === "models") showError("");
    } catch (err) {
      const message = err instanceof ApiError ? err.describe() : String(err);
      onModel(null, message);
      errorBox.dataset.source = "models";
      showError(`Could not list the models: ${message}`);
      // The engine may still be loading (503): try again shortly.
      if (!(err instanceof ApiError) || err.status === 503) setTimeout(loadModels, 2000);
    }
  }

  function conversation() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: prompt.value });
    return messages;
  }

  function requestBody() {
    const messages = conversation();
    const format = responseFormat();
    return {
      model: model.value,
      ...(format ? { response_format: format } : {}),
      messages,
      temperature: Number(temperature.value),
      // Sent as typed: the server checks the range and says what is wrong.
      max_tokens: Number($("max-tokens").value),
      stream: true,
      user: "playground", // the same user as its warm-ups (POST /v1/prefill): ends them
      // Usage on every chunk gives an exact running token count for tokens/s.
      stream_options: { include_usage: true, continuous_usage_stats: true },
    };
  }

  // JSON mode: any JSON object, or one that follows the schema typed (the server checks
  // the schema and says what is wrong with it).
  function responseFormat() {
    if (!jsonMode.checked) return null;
    const text = $("schema").value.trim();
    if (!text) return { type: "json_object" };
    let schema;
    try {
      schema = JSON.parse(text);
    } catch {
      throw new Error("The JSON schema is not valid JSON.");
    }
    return { type: "json_schema", json_schema: { name: "playground", schema } };
  }

  function showGuard(finish) {
    const guard = $("guard");
    guard.hidden = finish !== "content_filter";
    root.dataset.guard = finish === "content_filter" ? "tripped" : "";
    if (!guard.hidden) {
      guard.textContent = "A guard stopped this answer: what followed was replaced.";
    }
  }

  function checkJson(format) {
    const badge = $("json-check");
    badge.hidden = !format;
    if (!format) return;
    try {
      const value = JSON.parse(output.textContent);
      output.textContent = JSON.stringify(value, null, 2);
      badge.textContent = "valid JSON";
      badge.dataset.valid = "true";
    } catch {
      badge.textContent = "not valid JSON (cut by max tokens?)";
      badge.dataset.valid = "false";
    }
  }

  async function ask() {
    if (controller || !prompt.value.trim()) return;
    clearTimeout(warmTimer);
    controller = new AbortController();
    output.textContent = "";
    showError("");
    errorBox.dataset.source = "";
    const timing = new Timing();
    timing.render();
    showGuard(null);
    checkJson(null);
    setState("waiting", "waiting for the first token…");
    let finish = null;
    let body = null;
    try {
      body = requestBody();
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: authHeaders({ "content-type": "application/json" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw await errorFromResponse(response);
      current = {
        id: response.headers.get("x-request-id"),
        resumeToken: response.headers.get("x-sluicegate-resume-token"),
      };
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) throw errorFromEvent(event);
        const choice = event.choices?.[0];
        const text = choice?.delta?.content ?? "";
        if (text) {
          const atBottom = output.scrollHeight - output.scrollTop - output.clientHeight < 8;
          output.append(text);
          if (atBottom) output.scrollTop = output.scrollHeight;
          if (root.dataset.state === "waiting") setState("streaming", "streaming…");
        }
        timing.update(text, event.usage?.completion_tokens, choice?.finish_reason);
        finish = choice?.finish_reason || finish;
      }
      showGuard(finish);
      if (finish !== "content_filter") checkJson(body.response_format);
      setState("done", "");
    } catch (err) {
      if (err?.name === "AbortError") {
        setState("stopped", "stopped");
      } else {
        showError(err instanceof ApiError ? err.describe() : `Request failed: ${err}`);
        setState("error", "");
      }
    } finally {
      controller = null;
      current = null;
      timing.render();
    }
  }

  setState("idle");
  return { loadModels };
}

/** Time to first token and decode speed of one answer, shown as it streams. */
class Timing {
  constructor() {
    this.started = performance.now();
    this.firstAt = null; // when the first text arrived
    this.lastAt = null; // when the latest text arrived
    this.tokens = 0;
    this.tokensAtFirst = 0;
    this.finish = "";
  }

  update(text, completionTokens, finishReason) {
    const now = performance.now();
    // Without usage in the stream, count one token per text chunk (a lower bound).
    this.tokens = completionTokens ?? this.tokens + (text ? 1 : 0);
    if (text) {
      if (this.firstAt === null) {
        this.firstAt = now;
        this.tokensAtFirst = this.tokens;
      }
      this.lastAt = now;
    }
    if (finishReason) this.finish = finishReason;
    this.render();
  }

  render() {
    $("ttft").textContent =
      this.firstAt === null ? "–" : formatMs(this.firstAt - this.started);
    // Decode speed: tokens after the first chunk over the time since it arrived.
    const seconds = this.firstAt === null ? 0 : (this.lastAt - this.firstAt) / 1000;
    const tokens = this.tokens - this.tokensAtFirst;
    $("tps").textContent = seconds > 0.05 && tokens > 0 ? (tokens / seconds).toFixed(1) : "–";
    $("tokens").textContent = String(this.tokens);
    $("finish").textContent = this.finish ? `finish: ${this.finish}` : "";
  }
}

function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}
