// The page's side of app/live_feed.py. When the live-tree box holds an element with a
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

  const scrolledToEnd = (element) => {
    for (let box = element; box; box = box.parentElement) {
      if (box.scrollHeight > box.clientHeight + 1 && getComputedStyle(box).overflowY !== "visible") {
        return () => { if (box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight; };
      }
    }
    return () => {};
  };

  const apply = (box, record) => {
    if (record.reset !== undefined || record.text !== undefined) {
      const span = liveText();
      if (span) {
        const follow = scrolledToEnd(span);
        if (record.reset !== undefined) span.textContent = record.reset;
        if (record.text) span.appendChild(document.createTextNode(record.text));
        follow();
      }
    }
    if (record.tree !== undefined) {
      const tree = parse(record.tree);
      const place = box.querySelector(".sc-feed-tree");
      if (tree && place) place.innerHTML = tree.innerHTML;
    }
    if (record.stats !== undefined) {
      const place = box.querySelector(".sc-feed-stats");
      if (place) place.innerHTML = record.stats;
    }
    if (record.status !== undefined) {
      const status = parse(record.status);
      const place = document.querySelector("#sc-status .sc-status");
      if (status && place) { place.className = status.className; place.innerHTML = status.innerHTML; }
    }
  };

  const follow = (box) => {
    opened.add(box);
    cleanUp();
    if (source) source.close();
    const feed = new EventSource("sc-live/" + encodeURIComponent(box.dataset.scFeed));
    source = feed;
    feed.onopen = () => { const span = document.querySelector("#sc-chatbot .sc-live-text"); if (span) span.textContent = ""; };
    feed.onmessage = (event) => {
      const record = JSON.parse(event.data);
      if (record.end || !box.isConnected) {  // a box already gone: Gradio's final update came first
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
