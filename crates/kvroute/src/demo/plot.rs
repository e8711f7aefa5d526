//! The comparison chart of `kvroute demo` and `kvroute bench --plot`, as SVG and PNG.
//!
//! Owns: a three-panel bar chart (prefix reuse, TTFT p50, TTFT p99; one bar per row of the
//! table, with a whisker over the range of `--repeat` runs), laid out by plotters and set in
//! DejaVu Sans, a TTF embedded in the binary (`assets/fonts/`, its license beside it): plotters
//! measures with it, registered from those bytes, and the PNG's text is drawn by ab_glyph here
//! ([`Raster`]).
//! Invariants: every value axis starts at zero and names its unit; prefix reuse is drawn on
//! 0–100 %; each bar carries its value as the table prints it; a row keeps its colour in every
//! panel; the canvas widens so no two names under the bars overlap.
//! Must not: read fonts or anything else from the machine it runs on (the PNG looks the same
//! everywhere; the SVG names the family with a sans-serif fallback for its viewer to resolve).

use super::report::PolicyResult;
use ab_glyph::{Font, FontRef, OutlinedGlyph, PxScale, ScaleFont};
use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind,
};
use std::path::Path;
use std::sync::OnceLock;

/// DejaVu Sans 2.37, unmodified (Bitstream Vera license: `assets/fonts/LICENSE-DejaVu.txt`).
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// The family the chart is set in. The embedded font is registered under this name and the SVG
/// writes it verbatim, so a viewer without DejaVu Sans falls back to its own sans-serif.
const FAMILY: &str = "DejaVu Sans, sans-serif";

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(214, 39, 40),
    RGBColor(140, 86, 75),
];
const INK: RGBColor = RGBColor(30, 30, 30);
const GRID: RGBColor = RGBColor(225, 225, 225);

const HEIGHT: u32 = 460;
const MIN_WIDTH: u32 = 960;
const TITLE_PX: f64 = 22.0;
const CAPTION_PX: f64 = 18.0;
const AXIS_PX: f64 = 16.0;
const TICK_PX: f64 = 15.0;
/// Left of each panel: the y tick labels and the rotated axis description.
const Y_AREA: u32 = 72;
/// Below each panel: the names under the bars and the x axis description.
const X_AREA: u32 = 58;
const PANEL_MARGIN: u32 = 12;
/// The narrowest slot a bar gets, and the gap kept between neighbouring names.
const MIN_SLOT: u32 = 84;
const NAME_GAP: u32 = 16;
/// Longer names are cut to this many characters (bench targets can be URLs).
const MAX_NAME_CHARS: usize = 28;

struct Panel {
    caption: &'static str,
    axis: &'static str,
    values: Vec<f64>,
    ranges: Vec<Option<(f64, f64)>>,
    /// A fixed top for the axis (reuse: 100 %); otherwise the data decide it.
    top: Option<f64>,
}

fn panels(results: &[PolicyResult]) -> [Panel; 3] {
    let spread = |f: fn(&super::report::Spread) -> (f64, f64)| -> Vec<Option<(f64, f64)>> {
        results.iter().map(|r| r.spread.as_ref().map(f)).collect()
    };
    [
        Panel {
            caption: "prefix reuse, higher is better",
            axis: "prefix reuse (%)",
            values: results.iter().map(|r| r.reuse * 100.0).collect(),
            ranges: spread(|s| (s.reuse_min * 100.0, s.reuse_max * 100.0)),
            top: Some(100.0),
        },
        Panel {
            caption: "TTFT p50, lower is better",
            axis: "TTFT p50 (ms)",
            values: results.iter().map(|r| r.ttft_p50_ms).collect(),
            ranges: spread(|s| (s.ttft_p50_ms_min, s.ttft_p50_ms_max)),
            top: None,
        },
        Panel {
            caption: "TTFT p99, lower is better",
            axis: "TTFT p99 (ms)",
            values: results.iter().map(|r| r.ttft_p99_ms).collect(),
            ranges: spread(|s| (s.ttft_p99_ms_min, s.ttft_p99_ms_max)),
            top: None,
        },
    ]
}

/// A figure as the demo's table prints it; a missing one (no answers) as a dash.
fn fmt(v: f64) -> String {
    if !v.is_finite() {
        "–".to_string()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn name(r: &PolicyResult) -> String {
    if r.policy.chars().count() > MAX_NAME_CHARS {
        let cut: String = r.policy.chars().take(MAX_NAME_CHARS - 1).collect();
        format!("{cut}…")
    } else {
        r.policy.clone()
    }
}

/// Registers the embedded font with plotters (once per process).
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded font DejaVuSans.ttf did not parse"))
    }
}

fn font(px: f64) -> FontDesc<'static> {
    FontDesc::new(FontFamily::Name(FAMILY), px, FontStyle::Normal)
}

/// Bar slots per panel: one per row, or three for a single row so its bar sits in the middle
/// (plotters cannot place a one-value axis).
fn slots(rows: usize) -> usize {
    if rows == 1 {
        3
    } else {
        rows.max(1)
    }
}

/// The canvas, in pixels: wide enough that each bar's slot holds its name.
fn canvas(results: &[PolicyResult]) -> Result<(u32, u32)> {
    register_font()?;
    let mut widest = 0;
    for r in results {
        let (w, _) = font(TICK_PX)
            .box_size(&name(r))
            .map_err(|e| anyhow!("measuring a name: {e:?}"))?;
        widest = widest.max(w);
    }
    let slot = MIN_SLOT.max(widest + NAME_GAP);
    let panel = Y_AREA + 2 * PANEL_MARGIN + slots(results.len()) as u32 * slot;
    Ok((MIN_WIDTH.max(3 * panel), HEIGHT))
}

type DrawResult = Result<()>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    results: &[PolicyResult],
    title: &str,
    x_desc: &str,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let title = match results.iter().find_map(|r| r.spread.as_ref()) {
        Some(s) => format!(
            "{title} (bars: means of {} runs; whiskers: their range)",
            s.runs
        ),
        None => title.to_string(),
    };
    let body = root.titled(&title, font(TITLE_PX).color(&INK))?;
    if results.is_empty() {
        body.draw_text(
            "no results to plot",
            &font(CAPTION_PX).color(&INK),
            (20, 20),
        )?;
        return Ok(());
    }
    let names: Vec<String> = results.iter().map(name).collect();
    let n = results.len();
    let slots = slots(n);
    let offset = (slots - n) / 2;
    for (area, panel) in body.split_evenly((1, 3)).iter().zip(panels(results)) {
        draw_panel(area, &panel, &names, slots, offset, x_desc)?;
    }
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
    names: &[String],
    slots: usize,
    offset: usize,
    x_desc: &str,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
    let highest = p
        .values
        .iter()
        .copied()
        .chain(p.ranges.iter().flatten().map(|&(_, hi)| hi))
        .map(finite)
        .fold(0.0, f64::max);
    // Headroom above the tallest bar for its value label.
    let top = p.top.unwrap_or((highest * 1.15).max(1.0));
    let mut chart = ChartBuilder::on(area)
        .caption(p.caption, font(CAPTION_PX).color(&INK))
        .margin(PANEL_MARGIN)
        .x_label_area_size(X_AREA)
        .y_label_area_size(Y_AREA)
        .build_cartesian_2d((0..slots as i32 - 1).into_segmented(), 0.0..top)?;
    let decimals = if top >= 10.0 { 0 } else { 1 };
    let tick = |v: &f64| format!("{v:.decimals$}");
    let label = |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(i) => usize::try_from(*i)
            .ok()
            .and_then(|i| i.checked_sub(offset))
            .and_then(|i| names.get(i))
            .cloned()
            .unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .bold_line_style(GRID)
        .axis_style(INK)
        .y_labels(6)
        .y_label_formatter(&tick)
        .x_labels(slots)
        .x_label_formatter(&label)
        .label_style(font(TICK_PX).color(&INK))
        .axis_desc_style(font(AXIS_PX).color(&INK))
        .y_desc(p.axis)
        .x_desc(x_desc)
        .draw()?;
    let at = |i: usize| (offset + i) as i32;
    chart.draw_series(p.values.iter().enumerate().map(|(i, &v)| {
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(at(i)), 0.0),
                (SegmentValue::Exact(at(i) + 1), finite(v)),
            ],
            COLORS[i % COLORS.len()].filled(),
        );
        bar.set_margin(0, 0, 14, 14);
        bar
    }))?;
    chart.draw_series(p.ranges.iter().enumerate().filter_map(|(i, r)| {
        let (lo, hi) = (*r)?;
        let x = SegmentValue::CenterOf(at(i));
        Some(PathElement::new(
            vec![(x.clone(), finite(lo)), (x, finite(hi))],
            Color::stroke_width(&INK, 2),
        ))
    }))?;
    let value_style = font(TICK_PX)
        .color(&INK)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(p.values.iter().enumerate().map(|(i, &v)| {
        let above = p.ranges[i].map_or(finite(v), |(_, hi)| finite(hi).max(finite(v)));
        EmptyElement::at((SegmentValue::CenterOf(at(i)), above))
            + Text::new(fmt(v), (0, -4), value_style.clone())
    }))?;
    Ok(())
}

/// The chart as SVG text.
pub fn svg(results: &[PolicyResult], title: &str, x_desc: &str) -> Result<String> {
    let size = canvas(results)?;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        draw(&root, results, title, x_desc)?;
        root.present()?;
    }
    Ok(out)
}

/// The PNG's backend: plotters' bitmap backend with the text set here, by ab_glyph. plotters'
/// own ab_glyph text drops each glyph's left side bearing, which runs words together.
struct Raster<'a> {
    inner: BitMapBackend<'a>,
    font: FontRef<'static>,
}

type RasterError<'a> = DrawingErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>;

impl Raster<'_> {
    /// The line's glyph outlines, pen positions on a baseline at the font's ascent, and the
    /// line's (width, height) in pixels.
    fn layout(&self, text: &str, px: f64) -> (Vec<OutlinedGlyph>, f32, f32) {
        let font = self.font.as_scaled(PxScale::from(px as f32));
        let mut x = 0.0f32;
        let mut prev = None;
        let mut glyphs = Vec::new();
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(p) = prev {
                x += font.kern(p, id);
            }
            let glyph = id.with_scale_and_position(font.scale(), ab_glyph::point(x, font.ascent()));
            glyphs.extend(self.font.outline_glyph(glyph));
            x += font.h_advance(id);
            prev = Some(id);
        }
        (glyphs, x, font.ascent() - font.descent())
    }
}

impl<'a> DrawingBackend for Raster<'a> {
    type ErrorType = <BitMapBackend<'a> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }
    fn ensure_prepared(&mut self) -> Result<(), RasterError<'a>> {
        self.inner.ensure_prepared()
    }
    fn present(&mut self) -> Result<(), RasterError<'a>> {
        self.inner.present()
    }
    fn draw_pixel(&mut self, at: BackendCoord, color: BackendColor) -> Result<(), RasterError<'a>> {
        self.inner.draw_pixel(at, color)
    }
    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), RasterError<'a>> {
        self.inner.draw_line(from, to, style)
    }
    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), RasterError<'a>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }
    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), RasterError<'a>> {
        self.inner.draw_path(path, style)
    }
    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), RasterError<'a>> {
        self.inner.fill_polygon(vert, style)
    }
    fn estimate_text_size<S: BackendTextStyle>(
        &self,
        text: &str,
        style: &S,
    ) -> Result<(u32, u32), RasterError<'a>> {
        let (_, w, h) = self.layout(text, style.size());
        Ok((w.ceil() as u32, h.ceil() as u32))
    }
    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), RasterError<'a>> {
        let color = style.color();
        let (glyphs, w, h) = self.layout(text, style.size());
        let dx = match style.anchor().h_pos {
            HPos::Left => 0.0,
            HPos::Center => -w / 2.0,
            HPos::Right => -w,
        };
        let dy = match style.anchor().v_pos {
            VPos::Top => 0.0,
            VPos::Center => -h / 2.0,
            VPos::Bottom => -h,
        };
        // Whole-pixel offsets, so every glyph row and column moves alike.
        let (dx, dy) = (dx.round() as i32, dy.round() as i32);
        let turn = style.transform();
        let (cw, ch) = self.get_size();
        let mut result = Ok(());
        for g in &glyphs {
            let b = g.px_bounds();
            g.draw(|x, y, coverage| {
                if coverage <= 0.0 || result.is_err() {
                    return;
                }
                let lx = b.min.x as i32 + x as i32 + dx;
                let ly = b.min.y as i32 + y as i32 + dy;
                let (tx, ty) = turn.transform(lx, ly);
                let (px, py) = (pos.0 + tx, pos.1 + ty);
                if px >= 0 && py >= 0 && (px as u32) < cw && (py as u32) < ch {
                    let ink = BackendColor {
                        alpha: color.alpha * f64::from(coverage.min(1.0)),
                        rgb: color.rgb,
                    };
                    result = self.inner.draw_pixel((px, py), ink);
                }
            });
        }
        result
    }
}

/// The chart as RGB pixels: (width, height, 3 bytes per pixel, row by row).
fn raster(results: &[PolicyResult], title: &str, x_desc: &str) -> Result<(u32, u32, Vec<u8>)> {
    let (w, h) = canvas(results)?;
    let mut rgb = vec![255u8; w as usize * h as usize * 3];
    {
        let font = FontRef::try_from_slice(FONT)
            .map_err(|_| anyhow!("the embedded font DejaVuSans.ttf did not parse"))?;
        let inner = BitMapBackend::with_buffer(&mut rgb, (w, h));
        let root = Raster { inner, font }.into_drawing_area();
        draw(&root, results, title, x_desc)?;
        root.present()?;
    }
    Ok((w, h, rgb))
}

/// The chart as a PNG file at `path`.
pub fn png(results: &[PolicyResult], title: &str, x_desc: &str, path: &Path) -> Result<()> {
    let (w, h, rgb) = raster(results, title, x_desc)?;
    let file = std::fs::File::create(path)?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header()?;
    w.write_image_data(&rgb)?;
    w.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::report::Spread;

    fn row(policy: &str, reuse: f64, p50: f64, p99: f64) -> PolicyResult {
        PolicyResult {
            policy: policy.to_string(),
            reuse,
            prediction_error: 0.0,
            prediction_exact: 1.0,
            ttft_p50_ms: p50,
            ttft_p99_ms: p99,
            throughput_rps: 1.0,
            requests: 1000,
            failed: 0,
            per_worker: Default::default(),
            spread: None,
        }
    }

    fn demo_rows() -> Vec<PolicyResult> {
        vec![
            row("hybrid-aware", 0.432, 35.9, 2109.2),
            row("group-blind", 0.432, 36.9, 2064.9),
            row("round-robin", 0.132, 71.1, 2209.0),
            row("least-load", 0.124, 66.9, 2152.3),
        ]
    }

    fn pixel(rgb: &[u8], w: u32, x: u32, y: u32) -> [u8; 3] {
        let i = (y as usize * w as usize + x as usize) * 3;
        [rgb[i], rgb[i + 1], rgb[i + 2]]
    }

    /// Dark pixels (text and axes; every bar colour has a channel above 110) in a box.
    fn ink(rgb: &[u8], w: u32, xs: std::ops::Range<u32>, ys: std::ops::Range<u32>) -> usize {
        let mut n = 0;
        for y in ys {
            for x in xs.clone() {
                let [r, g, b] = pixel(rgb, w, x, y);
                if r.max(g).max(b) < 110 {
                    n += 1;
                }
            }
        }
        n
    }

    /// The tallest run of a colour in any column of the first (reuse) panel, in pixels.
    fn bar_height(rgb: &[u8], w: u32, h: u32, c: RGBColor) -> u32 {
        (0..w / 3)
            .map(|x| {
                (0..h)
                    .filter(|&y| pixel(rgb, w, x, y) == [c.0, c.1, c.2])
                    .count() as u32
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn the_png_decodes_at_the_canvas_size_with_text_in_the_title_and_on_the_axes() {
        let dir = std::env::temp_dir().join(format!("kvroute-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chart.png");
        png(
            &demo_rows(),
            "kvroute demo: 4 × qwen3-next",
            "policy",
            &path,
        )
        .unwrap();
        let decoder = png::Decoder::new(std::fs::File::open(&path).unwrap());
        let mut reader = decoder.read_info().unwrap();
        let mut rgb = vec![0; reader.output_buffer_size()];
        let frame = reader.next_frame(&mut rgb).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let (w, h) = (frame.width, frame.height);
        assert_eq!((w, h), canvas(&demo_rows()).unwrap());
        assert_eq!(frame.color_type, png::ColorType::Rgb);
        // The title, centred in the top band.
        assert!(ink(&rgb, w, w / 3..2 * w / 3, 0..30) > 200);
        // The rotated y axis description at the left edge of the first panel.
        assert!(ink(&rgb, w, 0..30, 100..h - 100) > 100);
        // The names under the bars and the x axis description, in the bottom band.
        assert!(ink(&rgb, w, 0..w / 3, h - X_AREA..h) > 300);
        // The corners stay background.
        assert_eq!(pixel(&rgb, w, 0, 0), [255, 255, 255]);
        assert_eq!(pixel(&rgb, w, w - 1, h - 1), [255, 255, 255]);
    }

    #[test]
    fn bars_grow_from_zero_so_their_heights_keep_the_values_ratio() {
        let rows = demo_rows();
        let (w, h, rgb) = raster(&rows, "t", "policy").unwrap();
        let full = bar_height(&rgb, w, h, COLORS[0]) as f64;
        let quarter = bar_height(&rgb, w, h, COLORS[2]) as f64;
        assert!(full > 50.0, "{full}");
        let ratio = quarter / full;
        assert!((ratio - 0.132 / 0.432).abs() < 0.02, "{ratio}");
    }

    #[test]
    fn the_svg_names_the_font_with_a_fallback_and_each_axis_with_its_unit() {
        let mut rows = demo_rows();
        rows[0].spread = Some(Spread {
            runs: 3,
            reuse_min: 0.42,
            reuse_max: 0.44,
            ttft_p50_ms_min: 34.0,
            ttft_p50_ms_max: 38.0,
            ttft_p99_ms_min: 2000.0,
            ttft_p99_ms_max: 2300.0,
        });
        let s = svg(&rows, "kvroute demo", "policy").unwrap();
        assert!(s.contains("font-family=\"DejaVu Sans, sans-serif\""));
        let texts: Vec<&str> = s.lines().map(str::trim).collect();
        for text in [
            "prefix reuse (%)",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "policy",
            "hybrid-aware",
            "least-load",
            "0",
            "2109",
        ] {
            assert!(texts.contains(&text), "{text} missing");
        }
    }

    #[test]
    fn long_names_widen_the_canvas_instead_of_overlapping() {
        let short = canvas(&demo_rows()).unwrap();
        let long: Vec<PolicyResult> = (0..4)
            .map(|i| row(&format!("http://10.0.0.{i}:8000/v1/route"), 0.5, 10.0, 20.0))
            .collect();
        let wide = canvas(&long).unwrap();
        assert!(wide.0 > short.0);
        assert_eq!(wide.1, HEIGHT);
    }

    #[test]
    fn one_row_and_no_rows_still_draw() {
        let (w, _, rgb) = raster(&demo_rows()[..1], "one", "policy").unwrap();
        assert!(bar_height(&rgb, w, HEIGHT, COLORS[0]) > 50);
        assert!(svg(&[], "none", "policy")
            .unwrap()
            .contains("no results to plot"));
    }
}
