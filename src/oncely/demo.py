"""Run the oncely demo: ``python -m oncely.demo --help``.

A retry storm against a payments function, with crashing workers, that ends with a check of the
bank's ledger: every payment charged exactly once. The code lives in `oncely._demos`.
"""

from oncely._demos.storm import main

if __name__ == "__main__":
    raise SystemExit(main())
