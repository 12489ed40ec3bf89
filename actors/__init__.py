"""The actors: one request actor per request (`request`), the step-loop actor (`step_loop`,
the scheduler core's async shell), the executor actor (`executor`, the one thread that runs
MLX work), the mailboxes and messages between them, and `turns` (several models' step loops
sharing the executor thread). The MLX-free scheduler is the `scheduler` package here.

May import `stepline.events`, `stepline.actors.scheduler` and, for the executor's work
only, `stepline.engine`; never `stepline.api`.
"""
