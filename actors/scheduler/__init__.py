"""The scheduler: everything that decides what a step does, MLX-free.

The core (core.py: one owner of the scheduling state, changed only by the event fold) and
the policy that turns that state into a step's plan (policy.py `schedule`), split by
concept: the configuration and plan types (plan.py), the prompts' order and fair share
(order.py), the decode batch's padded geometry (batch_geometry.py), a step's budget that
prompts, drafts and encodes try against and that says why it refused (budget.py),
admission and its errors (admission.py), the prefix lookups a step may make
(prefix_candidates.py) and image spans (spans.py); beside them the prefix index, the cost
model, the drafter and the model policy. Importing anything here has no side effects and
never imports MLX: it may import `stepline.events` and `stepline.actors.messages`/`host`,
never `stepline.engine` or `stepline.api`.
"""
