(() => {
  const $ = (id) => document.getElementById(id);
  const form = $("ask"), stopForm = $("stop-form"), answer = $("answer"), statusLine = $("status");
  const decoder = new TextDecoder();
  let gen = null, text = "", lastId = null, done = false, failure = null;
  let costShown = null;

  function setState(state, message) {
    $("result").dataset.state = state;
    statusLine.dataset.state = state;
    statusLine.className = "state " + state;
    statusLine.textContent = message;
    stopForm.hidden = !(state === "waiting" || state === "streaming");
    $("send").disabled = !stopForm.hidden;
  }

  function remember(id) {
    gen = id;
    $("generation").textContent = id ? "Generation " + id : "";
    stopForm.elements.g.value = id || "";
    const url = new URL(location.href);
    if (id) url.searchParams.set("g", id); else url.searchParams.delete("g");
    history.replaceState(null, "", url);
  }

  // What the page says of an error frame, `event: error` or a provider's `{"error": ...}`
  // (as the server's page does); null for a payload that is no error.
  function errorMessage(payload) {
    let error;
    try { error = JSON.parse(payload).error; } catch (e) { return null; }
    if (!error || typeof error !== "object") return null;
    if (error.type === "cancelled" && error.message === "stopped by its owner") return "Stopped.";
    return (error.message || "The stream failed.") + (error.type ? " (" + error.type + ")" : "");
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
    if (payload === "[DONE]") { done = true; return; }
    const error = errorMessage(payload);
    if (error !== null || event === "error") { failure = failure || error || payload; return; }
    try {
      const chunk = JSON.parse(payload);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && typeof delta.content === "string" && delta.content) {
        text += delta.content;
        answer.textContent = text;
        if (statusLine.dataset.state !== "streaming") setState("streaming", "Streaming…");
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

  // How a generation ended that its stream did not say (as the server's page says it).
  const ENDED = {
    cancelled: "Cancelled: its client left and the policy cancelled it.",
    interrupted: "Interrupted: the server stopped before the answer was complete.",
  };

  async function finish() {
    if (!done && !failure && gen) {
      try {
        const info = await (await fetch("/generations/" + gen)).json();
        failure = info.error === "stopped by its owner" ? "Stopped." : ENDED[info.status] || null;
      } catch (e) {}
    }
    if (done && !failure) setState("done", "Done.");
    else setState("failed", failure || "The answer ended before it was complete.");
    showCost();
  }

  // "metering…" until the usage record is settled, then what it cost and what reached us.
  async function showCost() {
    const id = gen;
    if (costShown === id) return;
    costShown = id;
    $("cost").textContent = "Cost: metering…";
    for (let i = 0; i < 120 && id === gen; i++) {
      const response = await fetch("/demo/usage/" + id);
      if (response.ok) { $("cost").textContent = (await response.json()).summary; return; }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  }

  // Reads on after the last event the resume stream numbered (its `id:`), or else from the
  // start, rebuilding the text: the first response's events carry no ids.
  async function resume(fromStart) {
    for (let attempt = 0; attempt < 20; attempt++) {
      if (fromStart || lastId === null) { text = ""; lastId = null; answer.textContent = ""; }
      const headers = { accept: "text/event-stream" };
      if (lastId !== null) headers["last-event-id"] = lastId;
      try {
        const response = await fetch("/generations/" + gen + "/stream", { headers });
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
    text = ""; lastId = null; done = false; failure = null; costShown = null;
    answer.textContent = ""; $("cost").textContent = "";
    remember(null);
    setState("waiting", "Waiting for the first token…");
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
    $("cost").textContent = "Cost: metering…";
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
  stopForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (gen) await fetch("/generations/" + gen + "/cancel", { method: "POST" });
  });

  async function panel() {
    try {
      const s = await (await fetch("/demo/stats")).json();
      // A sum that holds an estimate is marked, as the server marks it.
      for (const key of Object.keys(s)) {
        const cell = $("stat-" + key);
        if (cell) cell.textContent = (s[key + "_estimated"] ? "\u2248" : "") + s[key];
      }
      const svg = await (await fetch("/demo/chart")).text();
      const figure = $("chart"), old = figure.querySelector("svg");
      const holder = document.createElement("div");
      holder.innerHTML = svg;
      if (old && holder.firstElementChild) old.replaceWith(holder.firstElementChild);
    } catch (e) {}
    setTimeout(panel, 1000);
  }

  // The server rendered the page as the generation stood: read on from there, live.
  const existing = new URL(location.href).searchParams.get("g");
  const shown = $("result").dataset.state;
  if (existing && (shown === "waiting" || shown === "streaming")) {
    remember(existing);
    text = answer.textContent;
    const offset = Number($("result").dataset.offset);
    lastId = offset > 0 ? String(offset) : null;
    resume(lastId === null);
  } else if (existing && (shown === "done" || shown === "failed") && $("generation").textContent) {
    gen = existing;
    if ($("cost").textContent !== "Cost: metering…") costShown = gen;
    else showCost();
  }
  panel();
})();
