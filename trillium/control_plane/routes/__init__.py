"""One module per admin feature; each exposes `blueprint(state) -> Blueprint`."""
