/* nanoengine's step viewer: one engine step drawn as SVG and tables.

   Chapters 3 (scheduler), 4 (KV cache manager), 5 (engine skeleton) and 9
   (speculative decoding). The same code draws two things:
   - the live page of a running engine (/ui of `nanoengine serve`, or
     llm.serve_ui()): frames arrive as server-sent events read with fetch(),
     so the API key can travel in the Authorization header (EventSource
     cannot send headers);
   - the docs site's replays: <div class="ne-trace" data-trace="URL"> loads a
     trace file (a versioned JSON document) and adds a scrub bar.
   A frame is built by nanoengine/instruments/live_view/frames.py; the names
   here are its keys. Plain JavaScript and SVG: nothing to fetch, so the page
   works with no network. */
(function () {
  "use strict";

  const TRACE_FORMAT = "nanoengine-step-trace";
  const TRACE_VERSION = 1;
  // The 12 request states, in vLLM's order (RequestStatus).
  const STATES = ["WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS",
    "WAITING_FOR_STREAMING_REQ", "RUNNING", "PREEMPTED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
    "FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR", "FINISHED_REPETITION"];
  const GRID_MAX_BLOCKS = 2048;  // more blocks than this: the first ones drawn, all counted
  const CELL = 14;               // px per block in the grid
  const HISTORY_MAX = 2000;      // frames a live page keeps for its plots
  const SVG_NS = "http://www.w3.org/2000/svg";

  const LABELS = {
    en: {
      step: "step", time: "time", stepMs: "step time", live: "live", paused: "paused", replay: "replay",
      pause: "Pause", resume: "Resume", stepOnce: "Step", play: "Play", stop: "Stop",
      blocks: "KV blocks", free: "free", cached: "free, cached", held: "held", shared: "shared (prefix hit)",
      evicted: "evicted this step", hit: "prefix-cache hit", nullBlock: "null block",
      states: "Requests by state", requests: "Live requests", request: "request", state: "state",
      computed: "computed", toCompute: "to compute", budget: "This step's tokens against the budget",
      scheduled: "tokens scheduled", of: "of", preempted: "preempted", drafts: "drafts proposed",
      accepted: "accepted", plots: "Over time", kvUsage: "KV usage", running: "running", waiting: "waiting",
      throughput: "tokens generated / s", noFrames: "Waiting for the engine's first step ...",
      keyPrompt: "This server needs its API key:", keyWrong: "The server refused the API key (401).",
      connect: "Connect", lost: "Feed closed; reconnecting ...", notOrdered: "(cached blocks by id: pool too large to walk)",
      badTrace: "This trace cannot be shown", moreBlocks: "blocks drawn, of",
    },
    zh: {
      step: "step", time: "时间", stepMs: "step 耗时", live: "实时", paused: "已暂停", replay: "回放",
      pause: "暂停", resume: "继续", stepOnce: "单步", play: "播放", stop: "停止",
      blocks: "KV block", free: "空闲", cached: "空闲但有缓存", held: "被占用", shared: "共享（prefix 命中）",
      evicted: "本 step 被驱逐", hit: "prefix cache 命中", nullBlock: "空 block",
      states: "各状态的请求数", requests: "进行中的请求", request: "请求", state: "状态",
      computed: "已计算", toCompute: "待计算", budget: "本 step 的 token 与预算",
      scheduled: "已调度 token", of: "/", preempted: "被抢占", drafts: "提出的草稿",
      accepted: "被接受", plots: "随时间变化", kvUsage: "KV 使用率", running: "运行中", waiting: "等待中",
      throughput: "每秒生成 token", noFrames: "等待引擎的第一个 step ……",
      keyPrompt: "此服务器需要 API key：", keyWrong: "服务器拒绝了此 API key（401）。",
      connect: "连接", lost: "数据流已关闭，正在重连 ……", notOrdered: "（缓存 block 按编号列出：block 池太大，不逐个遍历）",
      badTrace: "无法显示此 trace", moreBlocks: "个 block 已画出，共",
    },
  };

  function lang() {
    return (document.documentElement.lang || "en").toLowerCase().startsWith("zh") ? "zh" : "en";
  }
  function t(key) { return LABELS[lang()][key] || LABELS.en[key]; }

  // ---- small DOM helpers ----------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    for (const child of children) node.append(child);
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    return node;
  }
  // One colour per request id, stable across frames: a hash of the id's characters, spread
  // round the colour wheel by the golden angle so that ids "0", "1", "2" get far-apart hues.
  function requestColour(id) {
    let hash = 0;
    for (const ch of String(id)) hash = (hash * 31 + ch.charCodeAt(0)) % 100003;
    return `hsl(${Math.round((hash * 137.508) % 360)}, 60%, 52%)`;
  }
  function label(id) { return /^\d+$/.test(id) ? `r${id}` : id; }

  // ---- trace files ----------------------------------------------------------------
  /* The frames of a trace document, or an Error saying what is wrong with it
     (the same checks as frames.check_trace_document). */
  function checkTrace(doc) {
    if (!doc || typeof doc !== "object" || doc.format !== TRACE_FORMAT) {
      throw new Error(`not a nanoengine step trace (expected format "${TRACE_FORMAT}")`);
    }
    if (doc.version !== TRACE_VERSION) {
      throw new Error(`trace version ${JSON.stringify(doc.version)}, but this viewer reads version ${TRACE_VERSION}`);
    }
    if (!Array.isArray(doc.frames) || doc.frames.length === 0) throw new Error("the trace has no frames");
    doc.frames.forEach((frame, index) => {
      const missing = ["step", "blocks", "counts", "scheduled"].filter(k => !frame || !(k in frame));
      if (missing.length) throw new Error(`frame ${index} lacks ${missing.join(", ")}`);
    });
    return doc.frames;
  }

  // ---- the view: one frame on screen ------------------------------------------------
  class StepView {
    constructor(root, mode) {
      this.root = root;
      root.classList.add("ne-view");
      this.header = el("div", {class: "ne-header"},
        el("span", {"data-k": "mode", class: "ne-mode"}, t(mode)),
        el("span", {}, `${t("step")} `, el("b", {"data-k": "step"}, "–")),
        el("span", {}, `${t("time")} `, el("b", {"data-k": "time"}, "–")),
        el("span", {}, `${t("stepMs")} `, el("b", {"data-k": "step-ms"}, "–")));
      this.controls = el("div", {class: "ne-controls"});
      this.message = el("div", {class: "ne-message", "data-k": "message"}, t("noFrames"));
      this.counts = el("div", {class: "ne-counts"});
      for (const [key, cls] of [["free", "free"], ["cached", "cached"], ["held", "held"]]) {
        this.counts.append(el("span", {class: `ne-swatch ne-${cls}`}), `${t(key)} `,
          el("b", {"data-k": key}, "–"), " ");
      }
      this.counts.append(`${t("kvUsage")} `, el("b", {"data-k": "kv-usage"}, "–"), " · ",
        `${t("running")} `, el("b", {"data-k": "running"}, "–"), " · ",
        `${t("waiting")} `, el("b", {"data-k": "waiting"}, "–"));
      this.grid = svg("svg", {class: "ne-grid", "data-k": "grid"});
      this.gridNote = el("div", {class: "ne-note", "data-k": "grid-note"});
      this.budget = el("div", {class: "ne-budget", "data-k": "budget"});
      this.budgetText = el("div", {class: "ne-note", "data-k": "budget-text"});
      this.events = el("ul", {class: "ne-events", "data-k": "events"});
      this.states = el("table", {class: "ne-states"});
      for (const state of STATES) {
        this.states.append(el("tr", {}, el("td", {}, state), el("td", {"data-state": state}, "0")));
      }
      this.requests = el("table", {class: "ne-requests", "data-k": "requests"});
      this.plots = el("div", {class: "ne-plots"});
      root.replaceChildren(this.header, this.controls, this.message,
        el("h4", {}, t("blocks")), this.counts, this.grid, this.gridNote,
        el("h4", {}, t("budget")), this.budget, this.budgetText, this.events,
        el("div", {class: "ne-columns"},
          el("div", {}, el("h4", {}, t("states")), this.states),
          el("div", {}, el("h4", {}, t("requests")), this.requests)),
        el("h4", {}, t("plots")), this.plots);
      this.cells = [];
      this.lastGridFrame = null;
    }

    setMode(mode) { this.root.querySelector("[data-k=mode]").textContent = t(mode); }
    setMessage(text) { this.message.textContent = text; this.message.hidden = !text; }
    k(key) { return this.root.querySelector(`[data-k="${key}"]`); }

    render(frame) {
      this.setMessage("");
      this.k("step").textContent = frame.step;
      this.k("time").textContent = `${frame.t.toFixed(2)} s`;
      this.k("step-ms").textContent = `${frame.step_ms.toFixed(1)} ms`;
      const counts = frame.counts;
      for (const key of ["free", "cached", "held", "running", "waiting"]) this.k(key).textContent = counts[key];
      this.k("kv-usage").textContent = `${(frame.kv_usage * 100).toFixed(1)}%`;
      for (const state of STATES) {
        this.states.querySelector(`[data-state="${state}"]`).textContent = counts.states[state] || 0;
      }
      this.renderGrid(frame);
      this.renderBudget(frame);
      this.renderRequests(frame);
      this.root.dataset.step = frame.step;
    }

    // The block pool: one square per block, coloured by what holds it.
    renderGrid(frame) {
      const blocks = frame.blocks;
      const drawn = Math.min(blocks.num_blocks, GRID_MAX_BLOCKS);
      const columns = Math.max(8, Math.floor((this.root.clientWidth || 640) / CELL) - 1);
      if (this.cells.length !== drawn) {
        this.grid.replaceChildren();
        this.cells = [];
        for (let id = 0; id < drawn; id++) {
          const rect = svg("rect", {x: (id % columns) * CELL, y: Math.floor(id / columns) * CELL,
            width: CELL - 2, height: CELL - 2, rx: 2, "data-block": id});
          rect.append(svg("title"));
          this.grid.append(rect);
          this.cells.push(rect);
        }
        this.grid.setAttribute("width", columns * CELL);
        this.grid.setAttribute("height", Math.ceil(drawn / columns) * CELL);
      }
      const kind = new Array(drawn).fill("free");
      const tip = new Array(drawn).fill("");
      const fill = new Array(drawn).fill("");
      kind[blocks.null_block] = "null";
      tip[blocks.null_block] = t("nullBlock");
      blocks.cached_free.forEach(([id, hash], position) => {
        if (id < drawn) { kind[id] = "cached"; tip[id] = `${t("cached")} #${position + 1} · ${hash}`; }
      });
      for (const [requestId, ids] of Object.entries(blocks.held)) {
        for (const id of ids) {
          if (id >= drawn) continue;
          const refs = blocks.shared[String(id)];
          kind[id] = refs ? "shared" : "held";
          fill[id] = requestColour(requestId);
          tip[id] = refs ? `${t("shared")}: ref_cnt ${refs}` : `${t("held")}: ${label(requestId)}`;
        }
      }
      const marks = new Map();
      for (const id of frame.evicted) marks.set(id, "evicted");
      for (const id of hitBlocks(frame)) marks.set(id, "hit");
      for (let id = 0; id < drawn; id++) {
        const rect = this.cells[id];
        rect.setAttribute("class", `ne-${kind[id]}${marks.has(id) ? ` ne-${marks.get(id)}` : ""}`);
        rect.dataset.kind = kind[id];
        if (fill[id]) rect.style.fill = fill[id]; else rect.style.removeProperty("fill");
        rect.firstChild.textContent = `block ${id}: ${tip[id] || t("free")}`;
      }
      const notes = [];
      if (drawn < blocks.num_blocks) notes.push(`${drawn} ${t("moreBlocks")} ${blocks.num_blocks}`);
      if (!blocks.lru_order) notes.push(t("notOrdered"));
      this.gridNote.textContent = notes.join(" ");
    }

    // The token budget as a bar: one piece per request's chunk (drafts hatched).
    renderBudget(frame) {
      const budget = Math.max(frame.budget, 1);
      this.budget.replaceChildren();
      let total = 0, drafts = 0, accepted = 0;
      for (const chunk of frame.scheduled) {
        total += chunk.num_tokens;
        drafts += chunk.num_draft_tokens;
        accepted += chunk.num_accepted_tokens;
        const own = chunk.num_tokens - chunk.num_draft_tokens;
        const range = chunk.kind === "decode" ? "" : ` ${chunk.start}–${chunk.start + own - 1}`;
        const piece = el("span", {class: `ne-piece ne-${chunk.kind}`, "data-request": chunk.request_id,
          title: `${label(chunk.request_id)} ${chunk.kind}${range}: ${chunk.num_tokens}`});
        piece.style.width = `${(100 * own) / budget}%`;
        piece.style.background = requestColour(chunk.request_id);
        piece.textContent = `${label(chunk.request_id)} ${chunk.kind[0].toUpperCase()}`;
        this.budget.append(piece);
        if (chunk.num_draft_tokens) {
          const draftPiece = el("span", {class: "ne-piece ne-draft",
            title: `${label(chunk.request_id)}: ${chunk.num_draft_tokens} ${t("drafts")}, ${chunk.num_accepted_tokens} ${t("accepted")}`});
          draftPiece.style.width = `${(100 * chunk.num_draft_tokens) / budget}%`;
          this.budget.append(draftPiece);
        }
      }
      this.budgetText.replaceChildren(`${t("scheduled")} `, el("b", {"data-k": "scheduled"}, total),
        ` ${t("of")} ${frame.budget}`);
      if (drafts) {
        this.budgetText.append(` · ${t("drafts")} `, el("b", {"data-k": "drafts"}, drafts),
          `, ${t("accepted")} `, el("b", {"data-k": "accepted"}, accepted));
      }
      this.events.replaceChildren();
      for (const p of frame.preemptions) {
        this.events.append(el("li", {class: "ne-preempt", "data-k": "preemption"},
          `${label(p.victim_id)} ${t("preempted")} (${p.reason}) → ${label(p.for_request_id)}`));
      }
      for (const chunk of frame.scheduled) {
        if (chunk.num_cached_tokens > 0) {
          this.events.append(el("li", {class: "ne-hit-line", "data-k": "hit"},
            `${label(chunk.request_id)}: ${t("hit")}, ${chunk.num_cached_tokens} tokens`));
        }
      }
      if (frame.evicted.length) {
        this.events.append(el("li", {"data-k": "evictions"}, `${t("evicted")}: ${frame.evicted.join(", ")}`));
      }
    }

    renderRequests(frame) {
      const head = el("tr", {}, el("th", {}, t("request")), el("th", {}, t("state")),
        el("th", {}, t("computed")), el("th", {}, t("toCompute")));
      const rows = frame.requests.map(r => el("tr", {"data-request": r.id},
        el("td", {}, el("span", {class: "ne-swatch", style: `background:${requestColour(r.id)}`}), label(r.id)),
        el("td", {}, r.state), el("td", {}, `${r.computed} / ${r.tokens}`), el("td", {}, r.tokens - r.computed)));
      this.requests.replaceChildren(head, ...rows);
    }
  }

  /* Blocks a request found in the prefix cache this step: the first
     num_cached_tokens / block_size blocks of its table. */
  function hitBlocks(frame) {
    const size = frame.block_size;
    const ids = [];
    for (const chunk of frame.scheduled) {
      const table = frame.blocks.held[chunk.request_id] || [];
      ids.push(...table.slice(0, Math.floor(chunk.num_cached_tokens / size)));
    }
    return ids;
  }

  // ---- plots: KV usage, queue lengths, throughput over the frames ------------------
  function throughputs(frames) {
    // Tokens generated per second over the last few frames (a step alone is too noisy).
    const window = 8;
    return frames.map((frame, i) => {
      const first = frames[Math.max(0, i - window)];
      const span = frame.t - first.t;
      let tokens = 0;
      for (let j = Math.max(0, i - window) + 1; j <= i; j++) tokens += frames[j].tokens_out;
      return span > 0 ? tokens / span : 0;
    });
  }

  function drawPlots(container, frames, cursor) {
    const series = [
      [t("kvUsage"), frames.map(f => f.kv_usage * 100), "%"],
      [`${t("running")} / ${t("waiting")}`, frames.map(f => f.counts.running), "", frames.map(f => f.counts.waiting)],
      [t("throughput"), throughputs(frames), ""],
    ];
    container.replaceChildren();
    const width = 300, height = 70;
    for (const [title, values, unit, second] of series) {
      const top = Math.max(1, ...values, ...(second || []));
      const x = i => (frames.length > 1 ? (i / (frames.length - 1)) * width : 0);
      const y = v => height - (v / top) * (height - 4);
      const plot = svg("svg", {width, height, class: "ne-plot", viewBox: `0 0 ${width} ${height}`});
      for (const [line, cls] of [[values, "ne-line"], [second, "ne-line2"]]) {
        if (!line) continue;
        plot.append(svg("polyline", {class: cls, points: line.map((v, i) => `${x(i)},${y(v)}`).join(" ")}));
      }
      if (cursor !== undefined) {
        plot.append(svg("line", {class: "ne-cursor", x1: x(cursor), x2: x(cursor), y1: 0, y2: height}));
      }
      const last = values[cursor !== undefined ? cursor : values.length - 1] || 0;
      container.append(el("figure", {}, plot,
        el("figcaption", {}, `${title}: ${last.toFixed(unit === "%" ? 1 : 0)}${unit} (max ${top.toFixed(0)}${unit})`)));
    }
  }

  // ---- the docs site's replays --------------------------------------------------------
  async function mountReplay(root) {
    const started = performance.now();
    let frames;
    try {
      const response = await fetch(root.dataset.trace);
      if (!response.ok) throw new Error(`${root.dataset.trace}: HTTP ${response.status}`);
      let doc;
      try { doc = await response.json(); } catch (error) { throw new Error(`${root.dataset.trace} is not JSON: ${error.message}`); }
      frames = checkTrace(doc);
    } catch (error) {
      root.classList.add("ne-view", "ne-error");
      root.replaceChildren(el("div", {class: "ne-message", "data-k": "message"}, `${t("badTrace")}: ${error.message}`));
      root.dataset.error = error.message;
      return;
    }
    const view = new StepView(root, "replay");
    const scrub = el("input", {type: "range", min: 0, max: frames.length - 1, value: 0, "data-k": "scrub",
      class: "ne-scrub"});
    const play = el("button", {type: "button", "data-k": "play"}, t("play"));
    view.controls.replaceChildren(play, scrub);
    const show = index => {
      view.render(frames[index]);
      drawPlots(view.plots, frames, index);
    };
    scrub.addEventListener("input", () => show(Number(scrub.value)));
    let timer = null;
    play.addEventListener("click", () => {
      if (timer) { clearInterval(timer); timer = null; play.textContent = t("play"); return; }
      play.textContent = t("stop");
      timer = setInterval(() => {
        const next = Number(scrub.value) + 1;
        if (next >= frames.length) { clearInterval(timer); timer = null; play.textContent = t("play"); return; }
        scrub.value = next;
        show(next);
      }, 120);
    });
    show(0);
    root.dataset.frames = frames.length;
    root.dataset.firstPaintMs = (performance.now() - started).toFixed(1);
  }

  // ---- the live page ------------------------------------------------------------------
  /* Server-sent events from fetch(): split the body at blank lines, each block
     an "event:" line and a "data:" line. */
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = /^event: (.*)$/m.exec(block);
        const data = /^data: (.*)$/m.exec(block);
        if (event && data) onEvent(event[1], JSON.parse(data[1]));
      }
    }
  }

  function mountLive(root, options) {
    const view = new StepView(root, "live");
    const history = [];
    let key = sessionStorage.getItem("nanoengine-api-key") || "";
    const headers = () => (key ? {Authorization: `Bearer ${key}`} : {});
    const pauseButton = el("button", {type: "button", "data-k": "pause"}, t("pause"));
    const stepButton = el("button", {type: "button", "data-k": "step-once", disabled: ""}, t("stepOnce"));
    let paused = false;
    const showGate = gate => {
      paused = gate.paused;
      view.setMode(paused ? "paused" : "live");
      pauseButton.textContent = paused ? t("resume") : t("pause");
      stepButton.disabled = !paused;
      root.dataset.paused = String(paused);
      root.dataset.stepsTaken = gate.steps_taken;
    };
    const click = async action => {
      const response = await fetch("/ui/api/control", {method: "POST",
        headers: {...headers(), "Content-Type": "application/json"}, body: JSON.stringify({action})});
      const body = await response.json();
      if (!response.ok) { view.setMessage(body.error ? body.error.message : `HTTP ${response.status}`); return; }
      showGate(body);
    };
    if (options.allowControl) {
      pauseButton.addEventListener("click", () => click(paused ? "resume" : "pause"));
      stepButton.addEventListener("click", () => click("step"));
      view.controls.replaceChildren(pauseButton, stepButton);
    }
    const askForKey = message => {
      const input = el("input", {type: "password", "data-k": "api-key", placeholder: "API key"});
      const button = el("button", {type: "button", "data-k": "connect"}, t("connect"));
      button.addEventListener("click", () => {
        key = input.value;
        sessionStorage.setItem("nanoengine-api-key", key);
        connect();
      });
      view.message.replaceChildren(`${message} ${t("keyPrompt")} `, input, button);
      view.message.hidden = false;
      root.dataset.auth = "refused";
    };
    let lastStep = -1;
    // Leaving the page ends its feed at once (else the server holds the stream open).
    const leaving = new AbortController();
    window.addEventListener("pagehide", () => leaving.abort());
    const connect = async () => {
      if (leaving.signal.aborted) return;
      let response;
      try {
        response = await fetch(`/ui/api/feed?after=${lastStep}`, {headers: headers(), signal: leaving.signal});
      } catch (error) {
        view.setMessage(t("lost"));
        setTimeout(connect, 1000);
        return;
      }
      if (response.status === 401) { askForKey(t("keyWrong")); return; }
      root.dataset.auth = "ok";
      await readEvents(response, (event, data) => {
        if (event === "hello" || event === "gate") showGate(data.gate || data);
        if (event === "hello") root.dataset.numBlocks = data.meta.num_blocks;
        if (event === "frame") {
          history.push(data);
          if (history.length > HISTORY_MAX) history.shift();
          lastStep = data.step;
          view.render(data);
          drawPlots(view.plots, history.slice(-300));
        }
      }).catch(() => undefined);
      view.setMessage(t("lost"));
      setTimeout(connect, 1000);
    };
    connect();
  }

  window.NanoViewer = {mountReplay, mountLive, checkTrace};
  const start = () => document.querySelectorAll(".ne-trace[data-trace]").forEach(mountReplay);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
