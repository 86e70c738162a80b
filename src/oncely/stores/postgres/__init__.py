"""The PostgreSQL store: durable, shared by many hosts, judged by the server's clock.

Needs the ``postgres`` extra (``pip install 'oncely[postgres]'``): psycopg 3 and its pool.
"""

from oncely.stores.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
