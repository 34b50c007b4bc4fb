"""One module per data-plane feature; each exposes `blueprint(state) -> Blueprint`."""
