// Talking to the server's public API: the API key, error bodies, and SSE parsing.

const KEY_STORAGE = "sluicegate.apiKey";

export function apiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return ""; // storage disabled: behave as if no key was set
  }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: the key lasts until the page is closed (kept by the input)
  }
}

/** Headers for every API call: the bearer token when a key is set. */
export function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, authorization: `Bearer ${key}` } : { ...extra };
}

/** An HTTP error answered by the server, with what a person needs to act on it. */
export class ApiError extends Error {
  constructor(status, statusText, message, retryAfter = null) {
    super(message);
    this.status = status;
    this.statusText = statusText;
    this.retryAfter = retryAfter;
  }

  /** One readable line, e.g. "429 Too Many Requests: … Retry after 7 s." */
  describe() {
    const head = this.status ? `${this.status} ${this.statusText}`.trim() + ": " : "";
    let text = head + this.message;
    if (this.retryAfter !== null && this.retryAfter !== "") {
      // Retry-After is either a number of seconds or an HTTP date.
      const seconds = Number(this.retryAfter);
      text += Number.isFinite(seconds)
        ? ` Retry after ${seconds} s.`
        : ` Retry after ${this.retryAfter}.`;
    }
    if (this.status === 401) text += " Set the API key at the top right.";
    return text;
  }
}

/** Build an ApiError from a non-2xx response; the body is OpenAI's {"error": {...}}. */
export async function errorFromResponse(response) {
  let message = "";
  try {
    const body = await response.json();
    message = body?.error?.message || "";
  } catch {
    // not JSON (a proxy's error page, say): the status line has to do
  }
  return new ApiError(
    response.status,
    response.statusText || "",
    message || "The server gave no reason.",
    response.headers.get("retry-after"),
  );
}

/** An error event inside a stream ({"error": {...}}), e.g. a stalled or failed stream. */
export function errorFromEvent(event) {
  const code = event.error.code || event.error.type || "";
  return new ApiError(0, "", (code ? `${code}: ` : "") + (event.error.message || "stream error"));
}

/**
 * Yield the data of each server-sent event of a response body.
 *
 * Lines starting with ":" are comments (the server's keep-alives) and are skipped; an
 * event's data lines are joined with "\n" and handed out at the blank line ending it.
 */
export async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split("\n");
      buffer = lines.pop(); // an incomplete line waits for the next chunk
      for (const raw of lines) {
        const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
        if (line === "") {
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
        // ":" comments and fields this API does not use (event:, id:, retry:) are ignored.
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
