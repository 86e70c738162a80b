"""The demos behind ``python -m oncely.demo`` and ``oncely demo``: a leaf, imported by nothing
but those two.

- `storm`: a retry storm against a payments function, with crashing workers, on SQLite.
- `outbox`: HTTP, inbox, outbox, relay, broker and consumer, each crashed at its worst point.
- `api`: a payments API behind the ASGI middleware, under a storm of retried requests.
"""
