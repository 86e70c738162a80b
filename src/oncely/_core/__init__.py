"""Pure core of oncely: records, the state machine, keys, fingerprints, codecs and flows.

Nothing in this package performs I/O, reads a clock or imports an optional dependency.
"""
