pub fn register(_r: &mut stitch_core::Registry) {}
