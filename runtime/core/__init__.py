"""The engine core in a process of its own, and its front-end side.

`process.py` runs an `Engine` behind two ZMQ sockets; `client.py` is the asyncio client an
API-server process uses; `messages.py` the msgspec wire types; `output_processor.py` turns
token-id outputs into text on the front end (detokenization, stop strings). Nothing here
imports FastAPI; the engine process never sees text or HTTP.
"""
