//! The PNG canvas: plotters' bitmap backend, with text drawn where the font places each glyph.
//!
//! plotters 0.3.7's ab_glyph text drops each glyph's left side bearing (it draws a glyph's
//! pixels from the pen position rather than from the glyph's pixel bounds), so digits with a
//! wide bearing stand apart: `128` reads `1 28`. This backend hands plotters' own text code a
//! style whose glyphs are offset by their bounds; everything else goes to the bitmap backend
//! unchanged. SVG needs none of this: its text is drawn by whoever views it.

use super::font;
use ab_glyph::{Font, ScaleFont};
use plotters::prelude::*;
use plotters_backend::text_anchor::Pos;
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind, FontFamily, FontStyle, FontTransform,
};

/// A bitmap backend whose text is placed right.
pub struct Raster<'a>(pub BitMapBackend<'a>);

/// `S` with its glyphs drawn from their pixel bounds.
struct Placed<'s, S>(&'s S);

impl<S: BackendTextStyle> BackendTextStyle for Placed<'_, S> {
    type FontError = S::FontError;

    fn color(&self) -> BackendColor {
        self.0.color()
    }

    fn size(&self) -> f64 {
        self.0.size()
    }

    fn transform(&self) -> FontTransform {
        self.0.transform()
    }

    fn style(&self) -> FontStyle {
        self.0.style()
    }

    fn anchor(&self) -> Pos {
        self.0.anchor()
    }

    fn family(&self) -> FontFamily<'_> {
        self.0.family()
    }

    fn layout_box(&self, text: &str) -> Result<((i32, i32), (i32, i32)), Self::FontError> {
        self.0.layout_box(text)
    }

    /// plotters' glyph loop (same pen advance, kerning and vertical placement), each glyph
    /// drawn from its pixel bounds' left edge.
    fn draw<E, F: FnMut(i32, i32, BackendColor) -> Result<(), E>>(
        &self,
        text: &str,
        (x0, y0): BackendCoord,
        mut draw: F,
    ) -> Result<Result<(), E>, Self::FontError> {
        let Some(font) = font::glyphs() else {
            return self.0.draw(text, (x0, y0), draw);
        };
        let size = self.0.size() as f32;
        let font = font.as_scaled(size);
        let color = self.0.color();
        let mut pen = 0f32;
        let mut prev = None;
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(p) = prev {
                pen += font.kern(p, id);
            }
            prev = Some(id);
            if let Some(outline) = font.outline_glyph(font.scaled_glyph(c)) {
                let bounds = outline.px_bounds();
                let left = pen as i32 + bounds.min.x as i32;
                let top = (size / 2.0 + bounds.min.y) as i32;
                let mut pixels = Vec::new();
                outline.draw(|x, y, coverage| pixels.push((x as i32 + left, y as i32 + top, coverage)));
                for (x, y, coverage) in pixels {
                    let mixed = BackendColor {
                        alpha: color.alpha * f64::from(coverage),
                        rgb: color.rgb,
                    };
                    if let Err(e) = draw(x0 + x, y0 + y, mixed) {
                        return Ok(Err(e));
                    }
                }
            }
            pen += font.h_advance(id);
        }
        Ok(Ok(()))
    }
}

impl DrawingBackend for Raster<'_> {
    type ErrorType = <BitMapBackend<'static> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.0.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.fill_polygon(vert, style)
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.draw_text(text, &Placed(style), pos)
    }

    fn estimate_text_size<S: BackendTextStyle>(
        &self,
        text: &str,
        style: &S,
    ) -> Result<(u32, u32), DrawingErrorKind<Self::ErrorType>> {
        self.0.estimate_text_size(text, style)
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        (w, h): (u32, u32),
        src: &[u8],
    ) -> Result<(), DrawingErrorKind<Self::ErrorType>> {
        self.0.blit_bitmap(pos, (w, h), src)
    }
}
