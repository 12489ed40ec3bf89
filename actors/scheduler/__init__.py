"""The scheduler: everything that decides what a step does, MLX-free.

The core (one owner of the scheduling state, changed only by the event fold), the policy
that turns that state into a step's plan, the prefix index, the cost model, the drafter and
the model policy. Importing anything here has no side effects and never imports MLX: it may
import `stepline.events` and `stepline.actors.messages`/`host`, never `stepline.engine` or
`stepline.api`.
"""
