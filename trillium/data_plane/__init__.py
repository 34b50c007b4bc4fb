"""OpenAI-compatible HTTP data plane (Quart-Trio on Hypercorn's trio worker).

    from trillium.data_plane import DataPlaneEngine, create_app, serve_app

See `app.py` for the public API and `context.py` for what the routes need.
Never imports `trillium.control_plane`.
"""

from trillium.data_plane.app import create_app, serve_app
from trillium.data_plane.context import DataPlaneEngine

__all__ = ["DataPlaneEngine", "create_app", "serve_app"]
