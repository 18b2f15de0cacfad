// Page boot: the API key field, the two views (#playground, #dashboard) and the header.

import { apiKey, setApiKey } from "./api.js";
import { initDashboard } from "./dashboard.js";
import { initPlayground } from "./playground.js";

const VIEWS = ["playground", "dashboard"];
const serverModel = document.getElementById("server-model");

const playground = initPlayground({
  onModel(model, error) {
    serverModel.textContent = model ?? "server unavailable";
    serverModel.title = error ?? "";
    serverModel.classList.toggle("ready", model !== null);
    serverModel.classList.toggle("down", model === null);
  },
});
const dashboard = initDashboard();

const keyInput = document.getElementById("api-key");
keyInput.value = apiKey();
keyInput.addEventListener("change", () => {
  setApiKey(keyInput.value.trim());
  playground.loadModels(); // a new key may unlock (or lock) the API
});
// Enter in the field commits it (the change event) instead of submitting a page load.
document.getElementById("api-key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  keyInput.blur();
});

function showView() {
  const name = VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : VIEWS[0];
  for (const view of VIEWS) document.getElementById(view).hidden = view !== name;
  for (const tab of document.querySelectorAll(".tabs a")) {
    tab.setAttribute("aria-selected", String(tab.dataset.view === name));
  }
  dashboard.setActive(name === "dashboard");
}

window.addEventListener("hashchange", showView);
showView();
playground.loadModels();
