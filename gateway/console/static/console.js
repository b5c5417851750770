// Console behaviour that a strict Content-Security-Policy (script-src 'self') allows:
// forms with data-confirm ask before submitting (key revocation).
document.addEventListener("submit", (event) => {
  const message = event.target.dataset && event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});
