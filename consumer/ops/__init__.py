"""The control plane around the hot path: accounting roll-up, dead letters, reaper, RQ jobs, inspect.

None of it runs on the step path. Modules: `common` (client from a URL, ops key names), `rollup`,
`deadletters`, `reaper`, `jobs` (RQ queue `dgr-ops`), `cron` (`rq cron consumer.ops.cron`),
`inspect` (`dgr inspect`), `cli` (`register(app)`). See docs/operations.md.
"""

from .common import LEDGER_INDEX, OpsKeys, connect, ledger_key

__all__ = ["LEDGER_INDEX", "OpsKeys", "connect", "ledger_key"]
