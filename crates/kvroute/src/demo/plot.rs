//! The demo's comparison chart, as SVG and PNG, without system fonts.
//!
//! Owns: a three-panel bar chart (prefix reuse, TTFT p50, TTFT p99 per policy), written as SVG
//! text and rasterized to PNG with a built-in 5×7 pixel font, so it renders the same on any
//! machine.
//! Must not: depend on fonts or libraries the machine may lack.

use super::report::PolicyResult;
use std::path::Path;

const W: usize = 960;
const H: usize = 420;
const COLORS: [[u8; 3]; 4] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [148, 103, 189],
];

struct Panel {
    title: &'static str,
    unit: &'static str,
    values: Vec<f64>,
}

fn panels(results: &[PolicyResult]) -> Vec<Panel> {
    vec![
        Panel {
            title: "prefix reuse",
            unit: "%",
            values: results.iter().map(|r| r.reuse * 100.0).collect(),
        },
        Panel {
            title: "ttft p50",
            unit: "ms",
            values: results.iter().map(|r| r.ttft_p50_ms).collect(),
        },
        Panel {
            title: "ttft p99",
            unit: "ms",
            values: results.iter().map(|r| r.ttft_p99_ms).collect(),
        },
    ]
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Bars as (x, y, w, h, color index), labels as (x, y, text, centered), in a W×H canvas.
struct Layout {
    bars: Vec<(usize, usize, usize, usize, usize)>,
    labels: Vec<(usize, usize, String, bool)>,
}

fn layout(results: &[PolicyResult], title: &str) -> Layout {
    let mut bars = Vec::new();
    let mut labels = vec![(W / 2, 14, title.to_string(), true)];
    let ps = panels(results);
    let pw = W / ps.len();
    for (pi, p) in ps.iter().enumerate() {
        let x0 = pi * pw + 30;
        let inner = pw - 60;
        let top = 60;
        let bottom = H - 90;
        labels.push((
            pi * pw + pw / 2,
            38,
            format!("{} ({})", p.title, p.unit),
            true,
        ));
        let max = p.values.iter().cloned().fold(0.0f64, f64::max).max(1e-9);
        let n = p.values.len().max(1);
        let bw = inner / n;
        for (i, v) in p.values.iter().enumerate() {
            let h = ((v / max) * (bottom - top) as f64).round().max(1.0) as usize;
            let x = x0 + i * bw + bw / 8;
            bars.push((x, bottom - h, bw * 3 / 4, h, i % COLORS.len()));
            labels.push((x + bw * 3 / 8, bottom - h - 12, fmt(*v), true));
        }
    }
    for (i, r) in results.iter().enumerate() {
        let x = 40 + i * (W - 80) / results.len().max(1);
        bars.push((x, H - 50, 14, 14, i % COLORS.len()));
        labels.push((x + 22, H - 47, r.policy.clone(), false));
    }
    Layout { bars, labels }
}

pub fn svg(results: &[PolicyResult], title: &str) -> String {
    let l = layout(results, title);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"monospace\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
    for (x, y, w, h, c) in &l.bars {
        let [r, g, b] = COLORS[*c];
        s.push_str(&format!(
            "<rect x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{h}\" fill=\"rgb({r},{g},{b})\"/>\n"
        ));
    }
    for (x, y, t, centered) in &l.labels {
        let anchor = if *centered { "middle" } else { "start" };
        let esc = t.replace('&', "&amp;").replace('<', "&lt;");
        s.push_str(&format!(
            "<text x=\"{x}\" y=\"{}\" text-anchor=\"{anchor}\">{esc}</text>\n",
            y + 10
        ));
    }
    s.push_str("</svg>\n");
    s
}

/// 5×7 glyphs, one string of 7 rows × 5 columns per character ('#' = ink).
fn glyph(c: char) -> Option<[&'static str; 7]> {
    Some(match c.to_ascii_lowercase() {
        '0' => [
            " ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### ",
        ],
        '1' => [
            "  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### ",
        ],
        '2' => [
            " ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####",
        ],
        '3' => [
            " ### ", "#   #", "    #", "  ## ", "    #", "#   #", " ### ",
        ],
        '4' => [
            "   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # ",
        ],
        '5' => [
            "#####", "#    ", "#### ", "    #", "    #", "#   #", " ### ",
        ],
        '6' => [
            " ### ", "#    ", "#### ", "#   #", "#   #", "#   #", " ### ",
        ],
        '7' => [
            "#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   ",
        ],
        '8' => [
            " ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### ",
        ],
        '9' => [
            " ### ", "#   #", "#   #", " ####", "    #", "    #", " ### ",
        ],
        'a' => [
            "     ", "     ", " ### ", "    #", " ####", "#   #", " ####",
        ],
        'b' => [
            "#    ", "#    ", "#### ", "#   #", "#   #", "#   #", "#### ",
        ],
        'c' => [
            "     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### ",
        ],
        'd' => [
            "    #", "    #", " ####", "#   #", "#   #", "#   #", " ####",
        ],
        'e' => [
            "     ", "     ", " ### ", "#   #", "#####", "#    ", " ### ",
        ],
        'f' => [
            "  ## ", " #   ", "#### ", " #   ", " #   ", " #   ", " #   ",
        ],
        'g' => [
            "     ", " ####", "#   #", "#   #", " ####", "    #", " ### ",
        ],
        'h' => [
            "#    ", "#    ", "#### ", "#   #", "#   #", "#   #", "#   #",
        ],
        'i' => [
            "  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### ",
        ],
        'j' => [
            "   # ", "     ", "  ## ", "   # ", "   # ", "#  # ", " ##  ",
        ],
        'k' => [
            "#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # ",
        ],
        'l' => [
            " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### ",
        ],
        'm' => [
            "     ", "     ", "## # ", "# # #", "# # #", "# # #", "# # #",
        ],
        'n' => [
            "     ", "     ", "#### ", "#   #", "#   #", "#   #", "#   #",
        ],
        'o' => [
            "     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### ",
        ],
        'p' => [
            "     ", "#### ", "#   #", "#   #", "#### ", "#    ", "#    ",
        ],
        'q' => [
            "     ", " ####", "#   #", "#   #", " ####", "    #", "    #",
        ],
        'r' => [
            "     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    ",
        ],
        's' => [
            "     ", "     ", " ####", "#    ", " ### ", "    #", "#### ",
        ],
        't' => [
            " #   ", " #   ", "#### ", " #   ", " #   ", " #  #", "  ## ",
        ],
        'u' => [
            "     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #",
        ],
        'v' => [
            "     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  ",
        ],
        'w' => [
            "     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # ",
        ],
        'x' => [
            "     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #",
        ],
        'y' => [
            "     ", "#   #", "#   #", "#   #", " ####", "    #", " ### ",
        ],
        'z' => [
            "     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####",
        ],
        '-' => [
            "     ", "     ", "     ", "#####", "     ", "     ", "     ",
        ],
        '.' => [
            "     ", "     ", "     ", "     ", "     ", " ##  ", " ##  ",
        ],
        '%' => [
            "##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##",
        ],
        '(' => [
            "   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # ",
        ],
        ')' => [
            " #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   ",
        ],
        ',' => [
            "     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   ",
        ],
        ':' => [
            "     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     ",
        ],
        '/' => [
            "    #", "    #", "   # ", "  #  ", " #   ", "#    ", "#    ",
        ],
        '=' => [
            "     ", "     ", "#####", "     ", "#####", "     ", "     ",
        ],
        '+' => [
            "     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     ",
        ],
        '×' => [
            "     ", "#   #", " # # ", "  #  ", " # # ", "#   #", "     ",
        ],
        ' ' => ["     "; 7],
        _ => return None,
    })
}

pub fn png(results: &[PolicyResult], title: &str, path: &Path) -> anyhow::Result<()> {
    let l = layout(results, title);
    let mut px = vec![255u8; W * H * 3];
    let put = |x: usize, y: usize, c: [u8; 3], px: &mut Vec<u8>| {
        if x < W && y < H {
            let i = (y * W + x) * 3;
            px[i..i + 3].copy_from_slice(&c);
        }
    };
    for (x, y, w, h, c) in &l.bars {
        for yy in *y..y + h {
            for xx in *x..x + w {
                put(xx, yy, COLORS[*c], &mut px);
            }
        }
    }
    for (x, y, t, centered) in &l.labels {
        let width = t.chars().count() * 6;
        let x0 = if *centered {
            x.saturating_sub(width / 2)
        } else {
            *x
        };
        for (i, ch) in t.chars().enumerate() {
            let g = glyph(ch).unwrap_or([
                "#####", "#   #", "#   #", "#   #", "#   #", "#   #", "#####",
            ]);
            for (row, bits) in g.iter().enumerate() {
                for (col, b) in bits.chars().enumerate() {
                    if b == '#' {
                        put(x0 + i * 6 + col, y + row, [20, 20, 20], &mut px);
                    }
                }
            }
        }
    }
    let file = std::fs::File::create(path)?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), W as u32, H as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header()?;
    w.write_image_data(&px)?;
    Ok(())
}
