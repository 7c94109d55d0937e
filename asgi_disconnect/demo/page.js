(() => {
  const $ = (id) => document.getElementById(id);
  const form = $("ask"), stopButton = $("stop"), answer = $("answer"), statusLine = $("status");
  const decoder = new TextDecoder();
  let gen = null, text = "", lastId = null, done = false, failure = null, stopped = false;
  let controller = null;

  function setState(state, message) {
    $("result").dataset.state = state;
    statusLine.dataset.state = state;
    statusLine.className = "state " + state;
    statusLine.textContent = message;
    stopButton.hidden = state !== "streaming";
    $("send").disabled = state === "streaming";
  }

  function remember(id) {
    gen = id;
    $("generation").textContent = id ? "Generation " + id : "";
    const url = new URL(location.href);
    if (id) url.searchParams.set("g", id); else url.searchParams.delete("g");
    history.replaceState(null, "", url);
  }

  function handle(block) {
    let event = "message", data = [], id = null;
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
      else if (field === "id") id = value;
    }
    if (id !== null) lastId = id;
    const payload = data.join("\n");
    if (event === "error") {
      let message = payload;
      try {
        const error = JSON.parse(payload).error || {};
        message = (error.message || "The stream failed.") + (error.type ? " (" + error.type + ")" : "");
        if (error.type === "cancelled" && stopped) message = "Stopped.";
      } catch (e) {}
      failure = message;
      return;
    }
    if (payload === "[DONE]") { done = true; return; }
    try {
      const chunk = JSON.parse(payload);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && typeof delta.content === "string") {
        text += delta.content;
        answer.textContent = text;
      }
    } catch (e) {}
  }

  // Reads an SSE body; returns normally at its end, throws if the connection broke.
  async function consume(body) {
    const reader = body.getReader();
    let buffer = "";
    for (;;) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        handle(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
  }

  function finish() {
    if (done) setState("done", "Done.");
    else setState("failed", failure || "The answer ended before it was complete.");
    showCost();
  }

  async function showCost() {
    const id = gen;
    $("cost").textContent = "Cost: metering…";
    for (let i = 0; i < 120 && id === gen; i++) {
      const response = await fetch("/demo/usage/" + id);
      if (response.ok) {
        const r = await response.json();
        const source = r.usage_source === "provider" ? "reported by the provider" : r.usage_source;
        const count = (n, what) => (n === null || n === undefined ? "unknown " + what : n + " " + what);
        $("cost").textContent = "Cost: " + count(r.input_tokens, "input") + " + " +
          count(r.output_tokens, "output tokens") + " (" + source + "), " +
          count(r.delivered_output_tokens, "delivered") + "; outcome " + r.outcome + ".";
        return;
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  }

  // After the last event the resume stream numbered (its `id:`), or else from the start,
  // rebuilding the text: the first response's events carry no ids.
  async function resume(fromStart) {
    for (let attempt = 0; attempt < 20; attempt++) {
      if (fromStart || lastId === null) { text = ""; lastId = null; answer.textContent = ""; }
      const headers = { accept: "text/event-stream" };
      if (lastId !== null) headers["last-event-id"] = lastId;
      try {
        controller = new AbortController();
        const response = await fetch("/generations/" + gen + "/stream", { headers, signal: controller.signal });
        if (response.status === 204) { finish(); return; }
        if (!response.ok) {
          setState("failed", "The generation cannot be read (" + response.status + ").");
          return;
        }
        await consume(response.body);
        if (done || failure) { finish(); return; }
      } catch (e) {}
      fromStart = false;
      await new Promise((resolve) => setTimeout(resolve, Math.min(200 * 2 ** attempt, 3000)));
    }
    finish();
  }

  async function start(prompt) {
    text = ""; lastId = null; done = false; failure = null; stopped = false;
    answer.textContent = ""; $("cost").textContent = "";
    remember(null);
    setState("streaming", "Streaming…");
    const route = $("detach").checked ? "/v1/reports" : "/v1/chat/completions";
    let response;
    try {
      response = await fetch(route, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ model: form.dataset.model, stream: true,
          stream_options: { include_usage: true }, messages: [{ role: "user", content: prompt }] }),
      });
    } catch (e) {
      setState("failed", "The gateway cannot be reached."); return;
    }
    if (!response.ok) {
      let detail = "";
      try { const body = await response.json(); detail = (body.error && (body.error.message || body.error.type)) || body.detail || ""; } catch (e) {}
      setState("failed", "The request failed (" + response.status + "): " + detail);
      return;
    }
    remember(response.headers.get("x-generation-id"));
    try {
      await consume(response.body);
    } catch (e) {}
    if (done || failure) { finish(); return; }
    await resume(true);  // the connection broke: read it again, then on, live
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    start($("prompt").value);
  });
  stopButton.addEventListener("click", async () => {
    if (!gen) return;
    stopped = true;
    await fetch("/generations/" + gen + "/cancel", { method: "POST" });
  });

  async function panel() {
    try {
      const s = await (await fetch("/demo/stats")).json();
      for (const key of Object.keys(s)) { const cell = $("stat-" + key); if (cell) cell.textContent = s[key]; }
    } catch (e) {}
    setTimeout(panel, 1000);
  }
  panel();

  const existing = new URL(location.href).searchParams.get("g");
  if (existing) { remember(existing); setState("streaming", "Resuming…"); resume(true); }
})();
