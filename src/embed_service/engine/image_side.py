"""Image inputs of a two-tower model (CLIP, SigLIP) on the embed routes, in the process that prepares them.

`ImageSide` is shared, like `TextSide`, by the `Engine` and a front end's `RemoteEngine`: a request whose
inputs hold images (images.inputs.ImageInput) is checked, its texts tokenized and its images decoded and
preprocessed where the request arrived (on the tokenization threads), into one sequence per input: a text's
token ids, or an image's placeholder ids (as many as its vision-tower tokens: its cost in the batcher) with
its pixel values in its OutputRequest. serving/images.py embeds them.

Such a request is refused (400) by a model without an image processor, with chunking (windows and late
chunking cut texts), with outputs other than dense; a prompt applies to its texts only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from embed_service import metrics
from embed_service.engine.admission import check_request
from embed_service.engine.errors import InvalidInputError
from embed_service.engine.text import EmbedOptions, TextSide
from embed_service.images.decode import ImageError, ImageLimits
from embed_service.images.fetch import FetchPolicy, pool
from embed_service.images.inputs import ImageInput, ImagePreparer, ImageStats
from embed_service.outputs import DENSE, DENSE_ONLY, OutputRequest

MixedInputs = list[str | ImageInput]
"""A request's inputs with images among its texts (requests/fields.py check_input)."""


def has_images(inputs: Any) -> bool:
    return any(isinstance(x, ImageInput) for x in inputs)


class ImageSide(TextSide):
    _preparer: ImagePreparer | None = None

    def image_preparer(self) -> ImagePreparer:
        """This model's images to pixels, within the server's limits; a text-only model refuses images."""
        if self._preparer is None:
            if "image" not in self.spec.modalities:
                raise InvalidInputError(
                    f"model {self.name} does not embed images (it serves text only); image inputs need a "
                    "CLIP or SigLIP model with its preprocessor_config.json (docs/models.md)"
                )
            s = self.settings
            limits = ImageLimits(
                s.max_image_pixels, s.max_image_bytes, s.max_request_image_bytes, s.max_request_image_pixels
            )
            fetching = FetchPolicy.of(
                s.allowed_media_domains,
                s.allowed_media_networks,
                s.media_fetch_timeout,
                s.media_max_redirects,
            )
            self._preparer = ImagePreparer(
                self.spec.image_processor, self.spec.tokens_per_image, limits, fetching
            )
        return self._preparer

    async def prepare_items(
        self, inputs: list[Any], opts: EmbedOptions
    ) -> tuple[list[list[int]], list[OutputRequest]]:
        """A request with images, checked, as its sequences (ids) and their output requests, in its order."""
        prep = self.image_preparer()
        output = self._output_checks(opts)
        if output.kinds != {DENSE}:
            raise InvalidInputError("image inputs give dense vectors only", param="outputs")
        if opts.chunking is not None:
            raise InvalidInputError(
                "chunking applies to texts; send a request with images without it", "chunking"
            )
        texts_at = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        texts = [inputs[i] for i in texts_at]
        prompt = self._prompt(texts, opts) if texts else None
        check_request([x if isinstance(x, str) else "" for x in inputs], prompt, self.limits)
        text_ids = (
            await self._tokenize_piece(texts, 0, len(texts), self.truncation(opts), prompt) if texts else []
        )
        stats = ImageStats()

        def decode() -> list[bytes]:
            budget = prep.request()
            return [
                prep.pixels(x.source, f"input {i}", budget, stats)
                for i, x in enumerate(inputs)
                if isinstance(x, ImageInput)
            ]

        # A request that fetches URLs waits on other hosts: on threads of its own, not the tokenization's.
        remote = any(isinstance(x, ImageInput) and prep.fetches(x.source) for x in inputs)
        loop = asyncio.get_running_loop()
        try:
            pixels = await loop.run_in_executor(pool("fetch", 16) if remote else self._tokenize_pool, decode)
        except ImageError as exc:
            raise InvalidInputError(str(exc)) from None
        finally:
            for result, n in stats.fetches.items():
                metrics.IMAGE_FETCHES.labels(self.name, result).inc(n)
        metrics.IMAGES.labels(self.name).inc(stats.images)
        metrics.IMAGE_BYTES.labels(self.name).inc(stats.bytes)
        metrics.IMAGE_DECODE_DURATION.labels(self.name).observe(stats.decode_seconds)
        texts_iter, pixels_iter = iter(text_ids), iter(pixels)
        ids: list[list[int]] = []
        outputs: list[OutputRequest] = []
        for x in inputs:
            if isinstance(x, ImageInput):
                ids.append(prep.placeholder())
                outputs.append(OutputRequest(pixels=next(pixels_iter)))
            else:
                ids.append(next(texts_iter))
                outputs.append(DENSE_ONLY)
        return ids, outputs
