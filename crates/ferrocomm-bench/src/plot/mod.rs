//! `ferrocomm-bench plot` and a sweep's `--plot`: latency and bus bandwidth against message
//! size from the bench's JSON (and its peers'), as PNG or SVG by the output's extension.

mod chart;
mod font;
mod raster;
mod series;

use crate::cli::PlotArgs;
use crate::report::Report;
use crate::Failure;
use plotters::prelude::*;
use std::path::Path;

/// The image formats, by file extension.
enum Format {
    Png,
    Svg,
}

impl Format {
    fn of(path: &Path) -> Result<Format, String> {
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("png") => Ok(Format::Png),
            Some("svg") => Ok(Format::Svg),
            _ => Err(format!("{}: the plot must be a .png or .svg file", path.display())),
        }
    }
}

/// Reads the JSON files and draws them.
pub fn run(p: &PlotArgs) -> Result<(), Failure> {
    // Before reading anything: a wrong extension is the cheapest mistake to report.
    Format::of(&p.output)?;
    let reports = p
        .inputs
        .iter()
        .map(|f| Report::read_json(f))
        .collect::<Result<Vec<_>, _>>()?;
    draw(&reports, &p.output)
}

/// Draws `reports` into `out` (.png or .svg).
pub fn draw(reports: &[Report], out: &Path) -> Result<(), Failure> {
    let format = Format::of(out)?;
    let panels = series::panels(reports)?;
    font::register()?;
    let (w, h) = chart::size(&panels);
    let bytes = match format {
        Format::Png => {
            let mut rgb = vec![0u8; w as usize * h as usize * 3];
            {
                let root = raster::Raster(BitMapBackend::with_buffer(&mut rgb, (w, h))).into_drawing_area();
                chart::draw(&root, &panels)?;
                root.present().map_err(|e| format!("drawing failed: {e}"))?;
            }
            encode_png(&rgb, w, h)?
        }
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
                chart::draw(&root, &panels)?;
                root.present().map_err(|e| format!("drawing failed: {e}"))?;
            }
            svg.into_bytes()
        }
    };
    std::fs::write(out, bytes).map_err(|e| format!("write {}: {e}", out.display()))?;
    Ok(())
}

/// 8-bit RGB pixels as a PNG file's bytes.
fn encode_png(rgb: &[u8], w: u32, h: u32) -> Result<Vec<u8>, String> {
    let mut file = Vec::new();
    let mut encoder = png::Encoder::new(&mut file, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let failed = |e: png::EncodingError| format!("PNG encoding failed: {e}");
    let mut writer = encoder.write_header().map_err(failed)?;
    writer.write_image_data(rgb).map_err(failed)?;
    writer.finish().map_err(failed)?;
    Ok(file)
}
