// devicekit serve: refresh the live part of the page without a full reload.
// Fetches /fragment (or the path in #live's data-fragment: /lab/fragment on the lab page; HTML
// the server has already escaped) every interval and swaps it in;
// when the server cannot be reached the badge turns "stale" and the last view stays.
(function () {
  "use strict";
  var live = document.getElementById("live");
  var state = document.getElementById("state");
  if (!live || !window.fetch) { return; }
  var interval = Math.max(parseInt(live.getAttribute("data-interval-ms"), 10) || 2000, 200);
  var source = live.getAttribute("data-fragment") === "/lab/fragment" ? "/lab/fragment" : "/fragment";
  var busy = false;

  function mark(ok, text) {
    if (!state) { return; }
    state.textContent = text;
    state.className = ok ? "state" : "state stale";
  }

  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(source, { cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        live.innerHTML = html;
        mark(true, "live");
      })
      .catch(function () { mark(false, "stale: server unreachable"); })
      .then(function () { busy = false; });
  }

  setInterval(refresh, interval);
  document.addEventListener("visibilitychange", refresh);
})();
