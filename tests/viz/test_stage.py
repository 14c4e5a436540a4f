"""``workbench.viz.stage``: the explorer's pictures on a grid, and the one HTML overlay that marks them."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from workbench.viz import _style
from workbench.viz.stage import HEADING_PX, Slot, inline_svg, stage


def test_pictures_take_grid_cells_whose_offsets_the_overlay_uses() -> None:
    placed = stage([("<b>a</b>", [("offsets", 560, 460), ("zoom", 360, 440)]), ("m", [("mesh", 520, 360)])])
    assert placed.columns == (560, 360) and placed.rows == (HEADING_PX, 460, HEADING_PX, 360)
    assert placed.grid_template_columns == "560px 360px"
    assert placed.grid_template_rows == f"auto {HEADING_PX}px 460px {HEADING_PX}px 360px"
    assert placed.overlay_area == "1 / 1 / 6 / 3"
    # grid lines: 1 starts the text row, 2 the first heading, 3 the first pictures, 5 the second row's
    assert placed.slot("offsets") == Slot("offsets", 3, 1, 0, HEADING_PX, 560, 460)
    assert placed.slot("zoom") == Slot("zoom", 3, 2, 560, HEADING_PX, 360, 440)
    assert placed.slot("mesh") == Slot("mesh", 5, 1, 0, 2 * HEADING_PX + 460, 520, 360)
    assert placed.slot("zoom").grid_area == "3 / 2 / 4 / 3"
    assert (placed.width, placed.height) == (920, 2 * HEADING_PX + 460 + 360)


def test_matplotlib_marks_go_inline_without_page_wide_parts() -> None:
    fig = Figure(figsize=(4, 3))
    ax = fig.add_axes((0.1, 0.1, 0.8, 0.8))
    box = ax.add_patch(Rectangle((0.2, 0.2), 0.3, 0.3, fill=False, gid="mark"))
    svg = _style.artists_svg(fig, [box])
    assert b"<?xml" in svg and b"<style" in svg and b"<metadata" in svg  # what a whole SVG document carries
    slot = Slot("offsets", 3, 1, 10, 26, 400, 300)
    inline = inline_svg(svg, slot)
    assert inline.startswith('<svg style="position:absolute;left:10px;top:26px;width:400px;height:300px"')
    assert "<?xml" not in inline and "DOCTYPE" not in inline and "<style" not in inline and "<metadata" not in inline
    # the style's settings are kept, inherited from the root
    assert 'stroke-linejoin="round" stroke-linecap="butt"' in inline.split(">", 1)[0]
    assert 'id="mark"' in inline and 'data-picture="offsets"' in inline


def test_overlay_holds_the_text_the_headings_and_every_picture_s_marks() -> None:
    placed = stage([("<b>shard offsets</b>", [("offsets", 100, 80)]), ("<b>mesh</b>", [("mesh", 90, 60)])])
    marks = {name: f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1 1"><g id="{name}"/></svg>'.encode()
             for name in ("offsets", "mesh")}
    html = placed.overlay("rank 7 <code>x</code>", marks, rank=7)
    assert html.startswith('<div class="wb-rank" data-rank="7"><div class="wb-text">rank 7 <code>x</code></div>')
    assert f'width:100px;height:{2 * HEADING_PX + 140}px' in html
    assert html.index("<b>shard offsets</b>") < html.index("<b>mesh</b>")
    assert f'top:{HEADING_PX}px;width:100px;height:80px" data-picture="offsets"' in html
    assert f'top:{2 * HEADING_PX + 80}px;width:90px;height:60px" data-picture="mesh"' in html
