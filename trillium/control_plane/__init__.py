"""Admin / RLHF HTTP control plane on its own port (QuartTrio on Hypercorn).

    from trillium.control_plane import ControlPlaneEngine, EngineStatus, create_admin_app, serve_admin_app

See `app.py` for the routes and `context.py` for what they need. Never
imports `trillium.data_plane`; the two planes share only the engine client
and (through `trillium serve`) the `EngineStatus.snapshot` probe.
"""

from trillium.control_plane.app import create_admin_app, data_port_mount, serve_admin_app
from trillium.control_plane.context import ControlPlaneEngine
from trillium.control_plane.status import EngineStatus

__all__ = ["ControlPlaneEngine", "EngineStatus", "create_admin_app", "data_port_mount", "serve_admin_app"]
