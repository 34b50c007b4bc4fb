"""The in-process ASGI calls run-batch sends its lines through, on a small QuartTrio app
(no engine): lifespan around the block, the body in, status / headers / body out, and no
disconnect before the response is written (a disconnect cancels a Quart-Trio handler)."""

from __future__ import annotations

import trio
from quart import Blueprint, jsonify, request
from quart_trio import QuartTrio

from trillium.batch.asgi_call import app_lifespan, post_json


def _app(events: list[str]) -> QuartTrio:
    app = QuartTrio("asgi-call-test")
    routes = Blueprint("r", __name__)

    @routes.post("/echo")
    async def echo():
        await trio.sleep(0.01)  # WHY: a handler that waits is cancelled if the client "disconnects"
        app.nursery.start_soon(trio.sleep, 0)  # the lifespan's nursery is there
        body = await request.get_json()
        return jsonify({"body": body, "query": request.args.to_dict()}), 201, {"X-Request-Id": "r-1"}

    app.register_blueprint(routes)
    app.before_serving(lambda: events.append("startup"))
    app.after_serving(lambda: events.append("shutdown"))
    return app


async def test_post_json_through_the_apps_own_asgi_callable():
    events: list[str] = []
    app = _app(events)
    async with app_lifespan(app):
        assert events == ["startup"]
        reply = await post_json(app, "/echo", "k=v", {"prompt": "hé"})
        assert reply.status == 201 and reply.headers["x-request-id"] == "r-1"
        assert reply.headers["content-type"].startswith("application/json")
        assert reply.json() == {"body": {"prompt": "hé"}, "query": {"k": "v"}}
        missing = await post_json(app, "/nope", "", {})
        assert missing.status == 404
        async with trio.open_nursery() as nursery:  # concurrent calls do not see each other's bodies
            replies = {}

            async def one(i):
                replies[i] = (await post_json(app, "/echo", "", {"i": i})).json()["body"]["i"]

            for i in range(5):
                nursery.start_soon(one, i)
        assert replies == {i: i for i in range(5)}
    assert events == ["startup", "shutdown"]
