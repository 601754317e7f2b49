//! When each layer's forward pass and its transfer ran, how close that is to the ideal
//! overlap, and a picture of it.

use std::fmt::Write;
use std::time::Duration;

/// An interval from the start of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Start, from the first layer's start.
    pub start: Duration,
    /// End, from the first layer's start.
    pub end: Duration,
}

impl Span {
    /// Its length.
    pub fn len(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// One layer: its compute, and the transfer of its KV (if it moved on its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerTimes {
    /// The layer.
    pub layer: u16,
    /// Its forward pass.
    pub compute: Span,
    /// Its transfer; `None` when the run moved everything as one batch (see
    /// [`Timeline::batch`]).
    pub transfer: Option<Span>,
}

/// A run's layers, and the whole-batch transfer when there was one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// A name for the picture (`layerwise`, `whole batch`).
    pub label: String,
    /// Every layer, in order.
    pub layers: Vec<LayerTimes>,
    /// A transfer of every layer at once after the last layer's compute.
    pub batch: Option<Span>,
    /// When decode held the whole KV where it computes from, if that is later than the last
    /// transfer (a copy from the landing memory into GPU memory).
    pub held: Option<Duration>,
    /// One layer's transfer on an otherwise idle link, when measured apart from this run
    /// (a whole-batch run's transfer divided by the layers): what the ideal adds to compute.
    /// Layerwise transfers queue behind each other when the link is the bottleneck, so the
    /// longest of them overstates it.
    pub layer_transfer: Option<Duration>,
}

impl Timeline {
    /// When decode held the whole KV: the end of the last transfer.
    pub fn complete_at(&self) -> Duration {
        let per_layer = self
            .layers
            .iter()
            .filter_map(|l| l.transfer.map(|t| t.end))
            .max()
            .unwrap_or_default();
        per_layer
            .max(self.batch.map_or(Duration::ZERO, |b| b.end))
            .max(self.held.unwrap_or_default())
    }

    /// The ideal: every layer's compute back to back plus one layer's transfer
    /// ([`Timeline::layer_transfer`] when known; else a whole batch's share per layer, else
    /// the longest layer transfer measured).
    pub fn ideal(&self) -> Duration {
        let compute: Duration = self.layers.iter().map(|l| l.compute.len()).sum();
        compute + self.one_layer_transfer()
    }

    /// One layer's transfer, as [`Timeline::ideal`] counts it.
    pub fn one_layer_transfer(&self) -> Duration {
        self.layer_transfer
            .or_else(|| {
                self.batch
                    .map(|b| b.len() / (self.layers.len().max(1) as u32))
            })
            .or_else(|| {
                self.layers
                    .iter()
                    .filter_map(|l| l.transfer.map(|t| t.len()))
                    .max()
            })
            .unwrap_or_default()
    }

    /// Mean compute per layer.
    pub fn compute_per_layer(&self) -> Duration {
        let compute: Duration = self.layers.iter().map(|l| l.compute.len()).sum();
        compute / (self.layers.len().max(1) as u32)
    }

    /// `complete_at / ideal` (1.0 is perfect overlap; the target is <= 1.1).
    pub fn vs_ideal(&self) -> f64 {
        self.complete_at().as_secs_f64() / self.ideal().as_secs_f64().max(1e-12)
    }

    /// Draws `runs` (e.g. layerwise and whole batch) on one time axis: per run, a row of
    /// compute per layer and a row of transfers, in SVG.
    pub fn svg(runs: &[&Timeline]) -> String {
        let end = runs
            .iter()
            .map(|t| t.complete_at())
            .max()
            .unwrap_or_default()
            .as_secs_f64()
            .max(1e-9);
        let (w, left, row, gap) = (1000.0, 120.0, 22.0, 30.0);
        let scale = (w - left - 20.0) / end;
        let height = 40.0 + runs.len() as f64 * (2.0 * row + gap) + 30.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let x = |d: Duration| left + d.as_secs_f64() * scale;
        let mut y = 30.0;
        for t in runs {
            let _ = writeln!(
                s,
                r#"<text x="4" y="{}" font-weight="bold">{}</text>"#,
                y - 8.0,
                escape(&t.label)
            );
            let _ = writeln!(s, r#"<text x="4" y="{}">compute</text>"#, y + 15.0);
            let _ = writeln!(s, r#"<text x="4" y="{}">transfer</text>"#, y + row + 15.0);
            for l in &t.layers {
                rect(
                    &mut s,
                    x(l.compute.start),
                    y,
                    l.compute.len().as_secs_f64() * scale,
                    row - 4.0,
                    "#4c78a8",
                    &format!("layer {} compute", l.layer),
                );
                if let Some(tr) = l.transfer {
                    rect(
                        &mut s,
                        x(tr.start),
                        y + row,
                        tr.len().as_secs_f64() * scale,
                        row - 4.0,
                        "#f58518",
                        &format!("layer {} transfer", l.layer),
                    );
                }
            }
            if let Some(b) = t.batch {
                rect(
                    &mut s,
                    x(b.start),
                    y + row,
                    b.len().as_secs_f64() * scale,
                    row - 4.0,
                    "#e45756",
                    "whole-batch transfer",
                );
            }
            let done = x(t.complete_at());
            let _ = writeln!(
                s,
                r#"<line x1="{done:.1}" x2="{done:.1}" y1="{}" y2="{}" stroke="black" stroke-dasharray="3,2"/><text x="{:.1}" y="{}">{:.2} ms ({:.2}x ideal)</text>"#,
                y - 4.0,
                y + 2.0 * row,
                done + 4.0,
                y + 2.0 * row - 4.0,
                t.complete_at().as_secs_f64() * 1e3,
                t.vs_ideal()
            );
            y += 2.0 * row + gap;
        }
        // Time axis in milliseconds.
        let ticks = 10;
        for k in 0..=ticks {
            let at = end * f64::from(k) / f64::from(ticks);
            let px = left + at * scale;
            let _ = writeln!(
                s,
                r#"<line x1="{px:.1}" x2="{px:.1}" y1="{}" y2="{}" stroke="gray"/><text x="{px:.1}" y="{}" text-anchor="middle">{:.1}</text>"#,
                y - 10.0,
                y - 4.0,
                y + 8.0,
                at * 1e3
            );
        }
        let _ = writeln!(s, r#"<text x="{}" y="{}">ms</text>"#, w - 20.0, y + 8.0);
        s.push_str("</svg>\n");
        s
    }
}

fn rect(s: &mut String, x: f64, y: f64, w: f64, h: f64, fill: &str, title: &str) {
    let _ = writeln!(
        s,
        r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" fill="{fill}"><title>{}</title></rect>"#,
        w.max(0.5),
        escape(title)
    );
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
