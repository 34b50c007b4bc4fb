"""Batch files: `trillium run-batch -i requests.jsonl -o results.jsonl --model ...`.

OpenAI's batch format in and out (lines.py), each line sent through the data
plane's own app in process (asgi_call.py), on the real engine in this
process (runner.py). The flags live in `trillium/cli_batch.py`.
"""
