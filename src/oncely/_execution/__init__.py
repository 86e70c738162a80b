"""The runtime every entry point shares: the protected-operation flows and their drivers.

Each step (acquire, settle, replay) is written once as a sans-I/O flow that yields operations
(`ops`); `run` and `arun` perform them against a sync or an async store (`drivers`); `call` and
`acall` are the decorator's straight line through the same steps (`fast`). Heartbeats are the one
place that needs a worker of each kind (`heartbeat`). The names below are what the rest of the
package uses; the modules' other names are theirs.
"""

from oncely._execution.drivers import aclaim, aperform, arun, perform, run
from oncely._execution.fast import acall, call
from oncely._execution.flows import (
    acquire,
    acquired,
    chain,
    complete_or_raise,
    complete_with,
    decoded,
    outcome_of,
    protected_call,
    raise_if_unstorable,
    rebuild_error,
    replay,
    settle,
    settle_error,
    suppressed,
)
from oncely._execution.heartbeat import (
    start_async_heartbeat,
    start_heartbeat,
    stop_async_heartbeat,
    stop_heartbeat,
)
from oncely._execution.lease import (
    CURRENT,
    CurrentLease,
    Lease,
    ainvoke_under,
    current_lease,
    invoke_under,
)
from oncely._execution.ops import Invoke, Sleep, StartHeartbeat, StopHeartbeat, StoreCall

__all__ = [
    "CURRENT",
    "CurrentLease",
    "Invoke",
    "Lease",
    "Sleep",
    "StartHeartbeat",
    "StopHeartbeat",
    "StoreCall",
    "acall",
    "aclaim",
    "acquire",
    "acquired",
    "ainvoke_under",
    "aperform",
    "arun",
    "call",
    "chain",
    "complete_or_raise",
    "complete_with",
    "current_lease",
    "decoded",
    "invoke_under",
    "outcome_of",
    "perform",
    "protected_call",
    "raise_if_unstorable",
    "rebuild_error",
    "replay",
    "run",
    "settle",
    "settle_error",
    "start_async_heartbeat",
    "start_heartbeat",
    "stop_async_heartbeat",
    "stop_heartbeat",
    "suppressed",
]
