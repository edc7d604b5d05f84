// Loaded first in the page's <head>, before Gradio's modules. Gradio's status tracker keeps
// animation-frame loops running while the page is idle (its elapsed-time counter, and the spring of
// its hidden logo loader), so an idle page drew 60 frames a second: about a tenth of a core, taken
// from the cores that decode. Frame requests from the status tracker, and those made while one of
// its delayed callbacks runs (the loops that continue it), wait 250 ms; every other caller is
// untouched.
(() => {
  const request = window.requestAnimationFrame.bind(window);
  const cancel = window.cancelAnimationFrame.bind(window);
  const SLOW_PERIOD_MS = 250;
  const delayed = new Map();  // negative ids handed out here -> their timeout
  let nextId = -1;
  let inSlowCallback = 0;
  const counts = { slowed: 0 };
  window.scQuietFrames = counts;
  const markedSlow = (callback) => (time) => {
    inSlowCallback += 1;
    try { callback(time); } finally { inSlowCallback -= 1; }
  };
  window.requestAnimationFrame = function (callback) {
    if (!inSlowCallback && !(new Error().stack || "").includes("statustracker")) return request(callback);
    counts.slowed += 1;
    const id = nextId--;
    delayed.set(id, setTimeout(() => { delayed.delete(id); request(markedSlow(callback)); }, SLOW_PERIOD_MS));
    return id;
  };
  window.cancelAnimationFrame = function (id) {
    if (id < 0) { clearTimeout(delayed.get(id)); delayed.delete(id); } else cancel(id);
  };
})();
