// The page's side of app/page/live_feed.py. When the live-tree box holds an element with a
// data-sc-feed token (the first update of a streaming answer), it reads /sc-live/<token> and
// applies each record itself: text deltas appended to the answer's bubble, the step's tree SVG,
// the status and stats lines. Gradio's final update of the answer then replaces all of it.
(() => {
  const opened = new WeakSet();
  let source = null;
  let finished = null;  // the box of the feed that ended, until Gradio's final update removes it

  const cleanUp = () => {
    document.querySelectorAll("#sc-chatbot .sc-live-text").forEach((span) => span.remove());
    document.querySelectorAll("#sc-chatbot .sc-live-answer").forEach((bot) => bot.classList.remove("sc-live-answer"));
  };

  const parse = (markup) => {
    const template = document.createElement("template");
    template.innerHTML = markup;
    return template.content.firstElementChild;
  };

  // The answer's text goes in a span of ours inside the last bot message, beside Gradio's own
  // content (hidden meanwhile by the sc-live-answer class): Gradio's nodes are never touched.
  const liveText = () => {
    const bots = document.querySelectorAll("#sc-chatbot .message.bot, #sc-chatbot [data-testid='bot']");
    const bot = bots[bots.length - 1];
    if (!bot) return null;
    let span = bot.querySelector(":scope .sc-live-text");
    if (!span) {
      span = document.createElement("span");
      span.className = "sc-live-text";
      bot.classList.add("sc-live-answer");
      bot.appendChild(span);
    }
    return span;
  };

  const scroller = (element) => {
    for (let box = element; box; box = box.parentElement) {
      if (box.scrollHeight > box.clientHeight + 1 && getComputedStyle(box).overflowY !== "visible") return box;
    }
    return null;
  };

  // Records wait for the next frame and are applied together there: every Chromium thread that
  // draws wakes once per frame rather than once per record, and on 2 cores each wake-up takes a
  // core from the decoding threads. Layout is read before anything is written (no forced layout
  // in between); text deltas keep their order, the rest keeps its latest value.
  let queued = [];
  let frame = 0;
  let scrollBox = null;

  const flush = (box) => {
    frame = 0;
    const records = queued;
    queued = [];
    let text = null, reset, tree, stats, status;
    for (const record of records) {
      if (record.reset !== undefined) { reset = record.reset; text = null; }
      if (record.text) text = (text || "") + record.text;
      if (record.tree !== undefined) tree = record.tree;
      if (record.stats !== undefined) stats = record.stats;
      if (record.status !== undefined) status = record.status;
    }
    const span = reset !== undefined || text !== null ? liveText() : null;
    if (span && (!scrollBox || !scrollBox.contains(span))) scrollBox = scroller(span);
    const atEnd = scrollBox && scrollBox.scrollHeight - scrollBox.scrollTop - scrollBox.clientHeight < 80;
    if (span) {
      if (reset !== undefined) span.textContent = reset;
      if (text) span.appendChild(document.createTextNode(text));
    }
    if (tree !== undefined) {
      const parsed = parse(tree);
      const place = box.querySelector(".sc-feed-tree");
      if (parsed && place) place.replaceChildren(...parsed.childNodes);
    }
    if (stats !== undefined) {
      const place = box.querySelector(".sc-feed-stats");
      if (place) place.innerHTML = stats;
    }
    if (status !== undefined) {
      const parsed = parse(status);
      const place = document.querySelector("#sc-status .sc-status");
      if (parsed && place) { place.className = parsed.className; place.replaceChildren(...parsed.childNodes); }
    }
    if (span && atEnd) scrollBox.scrollTop = scrollBox.scrollHeight;
  };

  const apply = (box, record) => {
    queued.push(record);
    if (!frame) frame = requestAnimationFrame(() => flush(box));
  };

  const follow = (box) => {
    opened.add(box);
    cleanUp();
    if (frame) cancelAnimationFrame(frame);
    frame = 0;
    queued = [];
    scrollBox = null;
    if (source) source.close();
    const feed = new EventSource("sc-live/" + encodeURIComponent(box.dataset.scFeed));
    source = feed;
    feed.onopen = () => { const span = document.querySelector("#sc-chatbot .sc-live-text"); if (span) span.textContent = ""; };
    feed.onmessage = (event) => {
      const record = JSON.parse(event.data);
      if (record.end || !box.isConnected) {  // a box already gone: Gradio's final update came first
        if (frame) { cancelAnimationFrame(frame); if (box.isConnected) flush(box); else { frame = 0; queued = []; } }
        feed.close();
        if (source === feed) source = null;
        finished = box;
        look();
        return;
      }
      apply(box, record);
    };
    feed.onerror = () => { if (feed.readyState === EventSource.CLOSED && source === feed) source = null; };
  };

  let pending = false;
  const look = () => {
    pending = false;
    if (finished && !finished.isConnected) { finished = null; cleanUp(); }
    const box = document.querySelector("#sc-live-tree [data-sc-feed]");
    if (box && !opened.has(box)) follow(box);
  };
  const start = () => new MutationObserver(() => {
    if (!pending) { pending = true; queueMicrotask(look); }
  }).observe(document.body, { childList: true, subtree: true });
  if (document.body) start(); else document.addEventListener("DOMContentLoaded", start);
})();
