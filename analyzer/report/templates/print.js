addEventListener("beforeprint", () => { for (const d of document.querySelectorAll("details:not([open])")) { d.dataset.printOpened = ""; d.open = true; } });
addEventListener("afterprint", () => { for (const d of document.querySelectorAll("details[data-print-opened]")) { delete d.dataset.printOpened; d.open = false; } });
