//! Integers in network byte order (big-endian), the one place Stitch spells it: read and
//! written where they lie in a header, or appended to a message being built. The integer's
//! own type gives the width, so `m.put(cookie)` writes 8 bytes for a `u64` cookie and
//! `get::<u16>(b, 2)` reads two.

/// An integer that travels in network byte order.
pub trait NetInt: Copy {
    const LEN: usize;
    /// The integer's bytes in network order, on the stack.
    type Bytes: AsRef<[u8]>;
    fn net(self) -> Self::Bytes;
    /// Writes the integer into the first `LEN` bytes of `out`.
    fn write(self, out: &mut [u8]);
    /// Reads the integer from the first `LEN` bytes of `b`.
    fn read(b: &[u8]) -> Self;
}

macro_rules! net_int {
    ($($t:ty),*) => {$(
        impl NetInt for $t {
            const LEN: usize = std::mem::size_of::<$t>();
            type Bytes = [u8; std::mem::size_of::<$t>()];
            #[inline]
            fn net(self) -> Self::Bytes {
                self.to_be_bytes()
            }
            #[inline]
            fn write(self, out: &mut [u8]) {
                out[..Self::LEN].copy_from_slice(&self.to_be_bytes());
            }
            #[inline]
            fn read(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::LEN]);
                <$t>::from_be_bytes(a)
            }
        }
    )*};
}

net_int!(u8, u16, u32, u64, u128, i8, i16, i32, i64);

/// The integer at `at` of `b` (which holds it: the caller checked the length).
#[inline]
pub fn get<I: NetInt>(b: &[u8], at: usize) -> I {
    I::read(&b[at..])
}

/// The integer at `at` of `b`, or `None` where `b` is too short to hold it.
#[inline]
pub fn try_get<I: NetInt>(b: &[u8], at: usize) -> Option<I> {
    b.get(at..at.checked_add(I::LEN)?).map(I::read)
}

/// Writes `value` at `at` of `b`.
#[inline]
pub fn set<I: NetInt>(b: &mut [u8], at: usize, value: I) {
    value.write(&mut b[at..]);
}

/// A message being built: integers appended in network byte order.
pub trait Put {
    fn put<I: NetInt>(&mut self, value: I);
}

impl Put for Vec<u8> {
    #[inline]
    fn put<I: NetInt>(&mut self, value: I) {
        let at = self.len();
        self.resize(at + I::LEN, 0);
        value.write(&mut self[at..]);
    }
}

/// The integer's bytes in network order, as a vector to build on.
#[inline]
pub fn bytes<I: NetInt>(value: I) -> Vec<u8> {
    value.net().as_ref().to_vec()
}

/// The integer's bytes in network order, on the stack (for a field given as bytes).
#[inline]
pub fn net<I: NetInt>(value: I) -> I::Bytes {
    value.net()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_come_from_the_type_and_bytes_are_in_network_order() {
        let mut m = vec![];
        m.put(0x0102u16);
        m.put(0x0304_0506u32);
        m.put(7u64);
        assert_eq!(m[..6], [1, 2, 3, 4, 5, 6]);
        assert_eq!(m.len(), 14);
        assert_eq!(get::<u32>(&m, 2), 0x0304_0506);
        assert_eq!(try_get::<u64>(&m, 6), Some(7));
        assert_eq!(try_get::<u64>(&m, 7), None);
        assert_eq!(try_get::<u16>(&m, usize::MAX), None);
        set(&mut m, 0, 0xfffeu16);
        assert_eq!(get::<u16>(&m, 0), 0xfffe);
    }
}
