//! The run's chart (`--png`): output tokens/s on the left; TTFT p50 and p99 and end-to-end p50
//! latency on the right; both against concurrency, on a log-2 axis so that 1, 4, 16 and 32 are
//! spread evenly.
//!
//! Drawn by plotters' bitmap backend in pure Rust. Text needs a font, and plotters is built
//! without its system font lookup (that would need fontconfig and FreeType), so a font file is
//! read at run time: `--font PATH`, else the first of [`SYSTEM_FONTS`] that exists. With none,
//! the chart is still drawn, without any text (no title, axis labels or legend), and a warning
//! says how to get them; a `--font` that cannot be used is an error.

use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::report::{LevelReport, Report};
use crate::commands::stats::Summary;

/// Where common systems keep a plain sans-serif font (Debian's and Ubuntu's fonts-dejavu-core
/// first).
const SYSTEM_FONTS: [&str; 8] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// The family every text on the chart asks for; the loaded font is registered under it.
const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (1200, 500);

/// Registers the chart's font; returns whether the chart can have text.
pub fn load_font(explicit: Option<&Path>) -> Result<bool> {
    let path = match explicit {
        Some(path) => path,
        None => match SYSTEM_FONTS.iter().map(Path::new).find(|p| p.is_file()) {
            Some(path) => path,
            None => {
                eprintln!(
                    "warning: no font found in the usual places; the chart will have no text \
                     (pass --font PATH to a TrueType font)"
                );
                return Ok(false);
            }
        },
    };
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    // plotters keeps registered fonts for the life of the process.
    register_font(
        FAMILY,
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| anyhow::anyhow!("{} is not a TrueType or OpenType font", path.display()))?;
    Ok(true)
}

/// Draws `report`'s levels into a PNG at `path`; with text only if `labels` (a font is loaded).
pub fn draw(path: &Path, report: &Report, labels: bool) -> Result<()> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = if labels {
        let s = &report.settings;
        let title = format!(
            "swarmgate loadgen: {}, {} scenario, model {}, {}, {} requests per level",
            s.url,
            s.scenario,
            s.model,
            if s.stream {
                "streaming"
            } else {
                "not streaming"
            },
            s.requests
        );
        root.titled(&title, (FAMILY, 20))?
    } else {
        root
    };
    let (left, right) = root.split_horizontally(SIZE.0 / 2);
    let levels = &report.levels;
    let xs = levels.iter().map(x);
    let (x_min, x_max) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let x_range = (x_min - 0.5)..(x_max + 0.5);
    let throughput: Vec<(f64, f64)> = levels
        .iter()
        .map(|l| (x(l), l.output_tokens_per_s))
        .collect();
    let throughput = [("tokens/s", BLUE, throughput)];
    let latency = |pick: fn(Summary) -> f64, of: fn(&LevelReport) -> Option<Summary>| {
        levels
            .iter()
            .filter_map(|l| of(l).map(|s| (x(l), pick(s))))
            .collect::<Vec<_>>()
    };
    let latencies = [
        ("TTFT p50", GREEN, latency(|s| s.p50, |l| l.ttft_ms)),
        ("TTFT p99", RED, latency(|s| s.p99, |l| l.ttft_ms)),
        ("e2e p50", MAGENTA, latency(|s| s.p50, |l| l.e2e_ms)),
    ];
    let text = |caption, unit| labels.then_some(Text { caption, unit });
    panel(
        &left,
        x_range.clone(),
        &throughput,
        text("Output throughput", "tokens/s"),
    )?;
    panel(&right, x_range, &latencies, text("Latency", "ms"))?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A level's place on the x axis: log2 of its concurrency.
fn x(level: &LevelReport) -> f64 {
    (level.concurrency as f64).log2()
}

type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

/// A panel's words, when the chart has text.
struct Text<'a> {
    caption: &'a str,
    unit: &'a str,
}

/// One chart of `series` (name, colour, points) in `area`, over `x_range` and from 0 up.
fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    x_range: Range<f64>,
    series: &[Series],
    text: Option<Text>,
) -> Result<()> {
    let y_max = series
        .iter()
        .flat_map(|(_, _, points)| points.iter().map(|&(_, y)| y))
        .fold(0.0, f64::max);
    let y_range = 0.0..(y_max * 1.1).max(1.0);
    let mut builder = ChartBuilder::on(area);
    builder.margin(20);
    if let Some(text) = &text {
        builder
            .caption(text.caption, (FAMILY, 18))
            .x_label_area_size(40)
            .y_label_area_size(70);
    }
    let mut chart = builder.build_cartesian_2d(x_range, y_range)?;
    let mut mesh = chart.configure_mesh();
    mesh.max_light_lines(2)
        .light_line_style(RGBColor(235, 235, 235));
    // Whole powers of two only: the levels' own ticks.
    let concurrency = |v: &f64| {
        if (v - v.round()).abs() < 1e-9 {
            format!("{}", 2f64.powf(v.round()))
        } else {
            String::new()
        }
    };
    let decimals = if y_max >= 10.0 { 0 } else { 2 };
    let value = |v: &f64| format!("{v:.decimals$}");
    if let Some(text) = &text {
        mesh.x_desc("concurrency")
            .y_desc(text.unit)
            .x_label_formatter(&concurrency)
            .y_label_formatter(&value)
            .label_style((FAMILY, 14));
    }
    mesh.draw()?;
    for (name, colour, points) in series {
        let colour = *colour;
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
    }
    if text.is_some() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FAMILY, 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::commands::loadgen::client::Sample;
    use crate::commands::loadgen::report::Settings;

    fn level(concurrency: usize, ttft_ms: u64) -> LevelReport {
        let sample = Sample {
            ttft: Duration::from_millis(ttft_ms),
            e2e: Duration::from_millis(ttft_ms * 4),
            gaps: vec![],
            output_tokens: 16,
            tpot: None,
        };
        LevelReport::new(concurrency, vec![Ok(sample)], Duration::from_millis(200))
    }

    #[test]
    fn a_chart_without_a_font_is_still_a_png() {
        let report = Report {
            settings: Settings {
                url: "http://127.0.0.1:8080/v1/chat/completions".into(),
                scenario: "chat",
                model: "default".into(),
                stream: true,
                concurrency: vec![1, 4, 16],
                requests: 1,
                max_tokens: 16,
                timeout_secs: 60,
            },
            levels: vec![level(1, 10), level(4, 30), level(16, 90)],
        };
        let dir = std::env::temp_dir().join(format!("loadgen-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chart.png");
        draw(&path, &report, false).unwrap();
        let png = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
        let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
        assert_eq!((width, height), SIZE);
    }
}
