//! The plots' one font. plotters draws text through ab_glyph from fonts registered with it, so
//! no system font library (fontconfig, freetype) is involved; DejaVu Sans comes embedded in
//! the `dejavu` crate (the Bitstream Vera licence: free to use and embed).

use ab_glyph::FontRef;
use std::sync::OnceLock;

/// The family every text of the plots uses.
pub const FAMILY: &str = "sans-serif";

/// The font, parsed once per process.
fn parsed() -> Option<&'static FontRef<'static>> {
    static FONT: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    FONT.get_or_init(|| FontRef::try_from_slice(dejavu::sans::regular()).ok())
        .as_ref()
}

/// Registers the font with plotters as `FAMILY`, once per process.
pub fn register() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let loads = parsed().is_some()
                && plotters::style::register_font(FAMILY, plotters::style::FontStyle::Normal, dejavu::sans::regular())
                    .is_ok();
            loads
                .then_some(())
                .ok_or_else(|| "the embedded font (DejaVu Sans) does not load".to_string())
        })
        .clone()
}

/// The font for drawing glyphs directly (src/plot/raster.rs); `None` if it does not load,
/// which `register` has already reported.
pub fn glyphs() -> Option<&'static FontRef<'static>> {
    parsed()
}
