"""One served model's part of the pipeline: its engine, the names clients send for it, and what
the server's options make of its tokenizer (chat template, reasoning tags, template
arguments, whether it reads images). A server of one model has one; a server of several
(api/pool.py) builds one as each model loads, and `Serving` binds a request to its model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stepline.api.config import ServerConfig
from stepline.api.pipeline.agents import configure
from stepline.api.pipeline.images import ImageOptions
from stepline.engine.images import ImageLimits

if TYPE_CHECKING:
    from stepline.api.engine import Engine


class ServedModel:
    def __init__(self, engine: Engine, config: ServerConfig, names: tuple[str, ...] = ()):
        """Raises ValueError for agent options (`--chat-template`, `--reasoning-parser`, ...)
        the model cannot honour."""
        self.engine = engine
        self.names: tuple[str, ...] = names or (engine.model_name,)
        self.images = ImageOptions(
            accepts_images=engine.accepts_images,
            allow_urls=config.allow_image_urls,
            fetch_timeout_s=config.image_fetch_timeout_s,
            limits=ImageLimits(
                config.max_image_bytes, config.max_image_pixels, config.max_images_per_request
            ),
        )
        # Applies --chat-template to the tokenizer.
        self.reasoning, self.default_template_kwargs = configure(
            engine.tokenizer,
            reasoning_parser=config.reasoning_parser,
            chat_template=config.chat_template,
            default_chat_template_kwargs=config.default_chat_template_kwargs,
        )
        self._token_text: dict[int, str] = {}
        self.door_facts: dict[str, Any] = {}  # what a door read once about the model

    @property
    def name(self) -> str:
        """The name it is listed by."""
        return self.names[0]

    def token_text(self, token_id: int) -> str:
        """One token's text (as logprobs show it), decoded once."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text


def served_model_factory(config: ServerConfig):
    """What a pool of models calls as each model loads (`ModelPool.open(on_load=...)`)."""

    def build(engine: Engine, spec: Any) -> ServedModel:
        return ServedModel(engine, config, spec.names)

    return build
