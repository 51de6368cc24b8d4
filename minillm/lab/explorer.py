"""Explorers that work in the HTML book: sliders over figures drawn ahead of time.

A notebook reader moves an ipywidgets slider and Python redraws the figure; a reader of the
HTML book has no kernel. `Explorer` draws the figure once for every position of its sliders
when the page is built, and writes a small HTML block: the sliders, the images, and a few
lines of JavaScript, inline, that show the image of the positions chosen. Nothing is
loaded from elsewhere, so it works offline and in the notebook alike.

    explorer = Explorer(
        draw,                                   # draw(**values) -> matplotlib Figure
        {"context": [1024, 8192, 32768], "batch": [1, 8, 64]},
        alt="Bars of KV-cache bytes per model at the chosen context and batch",
        labels={"context": "context (tokens)"},
    )
    explorer                                    # the last expression of a cell shows it

Every combination of values is drawn (keep the product small: a few dozen images). The
images are PNGs at 1.5 times the page's resolution, embedded as data URLs. A control whose
values are all numbers is a slider with a tick mark per value; one of names (a model, a GPU)
is a menu.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import numbers
import uuid
from collections.abc import Callable, Sequence
from typing import Any

MAX_STATES = 64


class Explorer:
    """Sliders over precomputed figures; shows as HTML in Jupyter and in the built book."""

    def __init__(
        self,
        draw: Callable[..., Any],
        sliders: dict[str, Sequence[Any]],
        alt: str,
        labels: dict[str, str] | None = None,
        initial: dict[str, Any] | None = None,
        dpi: int = 150,
    ) -> None:
        if not sliders:
            raise ValueError("an explorer needs at least one slider")
        for name, values in sliders.items():
            if len(values) < 2:
                raise ValueError(f"slider {name!r} needs at least two values, got {values!r}")
        num_states = 1
        for values in sliders.values():
            num_states *= len(values)
        if num_states > MAX_STATES:
            raise ValueError(
                f"{num_states} combinations of slider values: at most {MAX_STATES} are drawn"
            )
        if len(alt.split()) < 4:
            raise ValueError("alt text says what the figure shows, in at least four words")
        self.sliders = {name: list(values) for name, values in sliders.items()}
        self.labels = {name: (labels or {}).get(name, name) for name in sliders}
        self.alt = alt
        initial = initial or {}
        self.initial = [
            values.index(initial[name]) if name in initial else 0
            for name, values in self.sliders.items()
        ]
        self.images: list[str] = []  # data URLs, in itertools.product order of the indices
        for combination in itertools.product(*self.sliders.values()):
            figure = draw(**dict(zip(self.sliders, combination, strict=True)))
            self.images.append(_png_data_url(figure, dpi))

    def index_of(self, positions: Sequence[int]) -> int:
        """The image of slider positions (one index per slider), row-major as drawn."""
        index = 0
        for position, values in zip(positions, self.sliders.values(), strict=True):
            if not 0 <= position < len(values):
                raise IndexError(f"slider position {position} of {len(values)}")
            index = index * len(values) + position
        return index

    def _repr_html_(self) -> str:
        uid = "explorer-" + uuid.uuid4().hex[:8]
        controls = []
        for i, (name, values) in enumerate(self.sliders.items()):
            label = html.escape(self.labels[name])
            shown = html.escape(str(values[self.initial[i]]))
            if all(isinstance(v, numbers.Number) for v in values):
                # a quantity: a slider with a tick mark at each value drawn
                ticks = "".join(f'<option value="{k}"></option>' for k in range(len(values)))
                control = (
                    f'<input type="range" min="0" max="{len(values) - 1}" step="1" '
                    f'value="{self.initial[i]}" data-slider="{i}" list="{uid}-ticks-{i}" '
                    f'aria-label="{label}"><datalist id="{uid}-ticks-{i}">{ticks}</datalist>'
                )
            else:
                # a choice among names (a model, a GPU): a menu, not a slider
                options = "".join(
                    f'<option value="{k}"{" selected" if k == self.initial[i] else ""}>'
                    f"{html.escape(str(v))}</option>"
                    for k, v in enumerate(values)
                )
                control = f'<select data-slider="{i}" aria-label="{label}">{options}</select>'
            controls.append(
                f'<label class="minillm-explorer-control"><span>{label}</span> {control} '
                f'<output data-value="{i}">{shown}</output></label>'
            )
        first = self.images[self.index_of(self.initial)]
        values = json.dumps([[str(v) for v in vs] for vs in self.sliders.values()])
        images = json.dumps(self.images)
        script = f"""(function() {{
  const root = document.getElementById("{uid}");
  const images = {images};
  const values = {values};
  const sliders = root.querySelectorAll("[data-slider]");
  function update() {{
    let index = 0;
    sliders.forEach((s, i) => {{
      index = index * values[i].length + Number(s.value);
      root.querySelector('output[data-value="' + i + '"]').textContent = values[i][s.value];
    }});
    const img = root.querySelector("img");
    img.src = images[index];
    img.dataset.state = String(index);
  }}
  sliders.forEach((s) => {{
    s.addEventListener("input", update);
    s.addEventListener("change", update);
  }});
}})();"""
        return (
            f'<div class="minillm-explorer" id="{uid}">'
            f'<div class="minillm-explorer-controls">{"".join(controls)}</div>'
            f'<img src="{first}" alt="{html.escape(self.alt)}" '
            f'data-state="{self.index_of(self.initial)}" style="max-width:100%;height:auto">'
            f"<script>{script}</script></div>"
        )


def _png_data_url(figure, dpi: int) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(figure)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


__all__ = ["Explorer", "MAX_STATES"]
