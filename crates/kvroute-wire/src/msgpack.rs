//! A bounded, zero-copy msgpack reader over a byte slice.
//!
//! Owns: reading one value's head (marker, length, inline data), skipping whole values, and the
//! structural check of a payload ([`check_document`]) that runs before any typed decoding.
//! Invariants: every length is checked against the bytes that remain *before* anything is
//! sliced or allocated, so a hostile length prefix costs nothing; nesting is walked with an
//! explicit, capped stack (no recursion); nothing here allocates per element.
//! Must not: know about events, batches or engines; panic on any input.

use std::fmt;

/// Why a byte slice is not (acceptable) msgpack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MsgError {
    /// The data ends inside a value.
    Truncated,
    /// The reserved marker `0xc1`.
    ReservedMarker,
    /// Arrays or maps nest deeper than the configured limit.
    TooDeep,
    /// Bytes follow the single top-level value.
    TrailingBytes,
}

impl fmt::Display for MsgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MsgError::Truncated => "truncated msgpack",
            MsgError::ReservedMarker => "reserved msgpack marker 0xc1",
            MsgError::TooDeep => "msgpack nesting too deep",
            MsgError::TrailingBytes => "trailing bytes after the msgpack value",
        })
    }
}

/// The head of one msgpack value. Strings, binaries and extensions carry their data; arrays
/// and maps carry their element counts (the elements follow in the reader).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    /// Any non-negative integer, whatever its encoding (positive `int64` included).
    Uint(u64),
    /// A negative integer.
    Neg(i64),
    F32(f32),
    F64(f64),
    /// Raw string bytes (not checked for UTF-8 here).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext(i8, &'a [u8]),
}

impl Head<'_> {
    /// A short name of the msgpack type, for drop details.
    pub fn type_name(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "bool",
            Head::Uint(_) | Head::Neg(_) => "int",
            Head::F32(_) | Head::F64(_) => "float",
            Head::Str(_) => "str",
            Head::Bin(_) => "bin",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
            Head::Ext(..) => "ext",
        }
    }
}

/// A cursor over a msgpack byte slice.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgError> {
        if self.remaining() < n {
            return Err(MsgError::Truncated);
        }
        let start = self.pos;
        self.pos += n;
        self.buf.get(start..self.pos).ok_or(MsgError::Truncated)
    }

    fn byte(&mut self) -> Result<u8, MsgError> {
        Ok(self.take(1)?.first().copied().unwrap_or_default())
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, MsgError> {
        Ok(usize::from(self.byte()?))
    }
    fn len16(&mut self) -> Result<usize, MsgError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }
    fn len32(&mut self) -> Result<usize, MsgError> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| MsgError::Truncated)
    }

    /// A container count, refused when the remaining bytes cannot hold that many elements
    /// (each element takes at least one byte; a map entry two).
    fn count(&self, n: usize, per: usize) -> Result<u32, MsgError> {
        if n.saturating_mul(per) > self.remaining() {
            return Err(MsgError::Truncated);
        }
        u32::try_from(n).map_err(|_| MsgError::Truncated)
    }

    /// Reads the next value's head. Containers' elements stay in the reader.
    pub fn head(&mut self) -> Result<Head<'a>, MsgError> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Head::Uint(u64::from(m)),
            0x80..=0x8f => Head::Map(self.count(usize::from(m & 0x0f), 2)?),
            0x90..=0x9f => Head::Array(self.count(usize::from(m & 0x0f), 1)?),
            0xa0..=0xbf => Head::Str(self.take(usize::from(m & 0x1f))?),
            0xc0 => Head::Nil,
            0xc1 => return Err(MsgError::ReservedMarker),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.len8()?;
                Head::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.len16()?;
                Head::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            0xc7 => {
                let n = self.len8()?;
                self.ext(n)?
            }
            0xc8 => {
                let n = self.len16()?;
                self.ext(n)?
            }
            0xc9 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            0xca => Head::F32(f32::from_be_bytes(self.be()?)),
            0xcb => Head::F64(f64::from_be_bytes(self.be()?)),
            0xcc => Head::Uint(u64::from(self.byte()?)),
            0xcd => Head::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            0xce => Head::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            0xcf => Head::Uint(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(i64::from(i8::from_be_bytes(self.be()?))),
            0xd1 => signed(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => signed(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            0xd4 => self.ext(1)?,
            0xd5 => self.ext(2)?,
            0xd6 => self.ext(4)?,
            0xd7 => self.ext(8)?,
            0xd8 => self.ext(16)?,
            0xd9 => {
                let n = self.len8()?;
                Head::Str(self.take(n)?)
            }
            0xda => {
                let n = self.len16()?;
                Head::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            0xdc => {
                let n = self.len16()?;
                Head::Array(self.count(n, 1)?)
            }
            0xdd => {
                let n = self.len32()?;
                Head::Array(self.count(n, 1)?)
            }
            0xde => {
                let n = self.len16()?;
                Head::Map(self.count(n, 2)?)
            }
            0xdf => {
                let n = self.len32()?;
                Head::Map(self.count(n, 2)?)
            }
            0xe0..=0xff => Head::Neg(i64::from(m as i8)),
        })
    }

    fn ext(&mut self, n: usize) -> Result<Head<'a>, MsgError> {
        let ty = i8::from_be_bytes(self.be()?);
        Ok(Head::Ext(ty, self.take(n)?))
    }

    /// Skips one whole value (containers included) and returns the bytes it covered.
    /// `max_depth` bounds the container nesting *inside* this value (0: scalars only).
    pub fn value_slice(&mut self, max_depth: usize) -> Result<&'a [u8], MsgError> {
        let start = self.pos;
        // Each entry: elements still to read in an open container.
        let mut stack: Vec<u64> = Vec::new();
        let mut pending: u64 = 1;
        loop {
            while pending == 0 {
                match stack.pop() {
                    Some(p) => pending = p,
                    None => return self.buf.get(start..self.pos).ok_or(MsgError::Truncated),
                }
            }
            pending -= 1;
            let inner = match self.head()? {
                Head::Array(n) => u64::from(n),
                Head::Map(n) => 2 * u64::from(n),
                _ => continue,
            };
            if inner == 0 {
                continue;
            }
            if stack.len() >= max_depth {
                return Err(MsgError::TooDeep);
            }
            stack.push(pending);
            pending = inner;
        }
    }
}

fn signed(v: i64) -> Head<'static> {
    if v >= 0 {
        Head::Uint(v.unsigned_abs())
    } else {
        Head::Neg(v)
    }
}

/// Checks that `buf` is exactly one well-formed msgpack value whose containers nest at most
/// `max_depth` deep. After this, typed decoding of `buf` cannot meet a structural error.
pub fn check_document(buf: &[u8], max_depth: usize) -> Result<(), MsgError> {
    let mut r = Reader::new(buf);
    r.value_slice(max_depth)?;
    if r.remaining() != 0 {
        return Err(MsgError::TrailingBytes);
    }
    Ok(())
}

/// Reads a sub-slice known to hold exactly one value and returns its head (with a reader
/// positioned on its elements, for containers).
pub fn open(raw: &[u8]) -> Result<(Head<'_>, Reader<'_>), MsgError> {
    let mut r = Reader::new(raw);
    let h = r.head()?;
    Ok((h, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_integer_encoding_reads_as_its_value() {
        let cases: &[(&[u8], Head)] = &[
            (&[0x05], Head::Uint(5)),
            (&[0xff], Head::Neg(-1)),
            (&[0xcc, 0xff], Head::Uint(255)),
            (&[0xcd, 0x01, 0x00], Head::Uint(256)),
            (&[0xce, 0, 1, 0, 0], Head::Uint(65536)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Head::Uint(u64::MAX),
            ),
            (&[0xd0, 0x80], Head::Neg(-128)),
            (&[0xd3, 0, 0, 0, 0, 0, 0, 0, 7], Head::Uint(7)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Head::Neg(i64::MIN)),
        ];
        for (bytes, want) in cases {
            assert_eq!(Reader::new(bytes).head(), Ok(*want), "{bytes:x?}");
        }
    }

    #[test]
    fn a_hostile_array_length_is_refused_before_anything_is_read() {
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).head(),
            Err(MsgError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]).head(),
            Err(MsgError::Truncated)
        );
    }

    #[test]
    fn nesting_past_the_limit_is_refused_without_recursion() {
        let deep = vec![0x91u8; 100_000];
        assert_eq!(check_document(&deep, 64), Err(MsgError::TooDeep));
        let mut ok = vec![0x91u8; 10];
        ok.push(0xc0);
        assert_eq!(check_document(&ok, 10), Ok(()));
        assert_eq!(check_document(&ok, 9), Err(MsgError::TooDeep));
    }

    #[test]
    fn trailing_bytes_and_reserved_markers_are_errors() {
        assert_eq!(
            check_document(&[0xc0, 0xc0], 4),
            Err(MsgError::TrailingBytes)
        );
        assert_eq!(
            check_document(&[0x91, 0xc1], 4),
            Err(MsgError::ReservedMarker)
        );
        assert_eq!(check_document(&[], 4), Err(MsgError::Truncated));
    }

    #[test]
    fn value_slice_covers_exactly_one_value() {
        let buf = [0x92, 0x01, 0x81, 0xa1, b'k', 0xc0, 0x07];
        let mut r = Reader::new(&buf);
        assert_eq!(r.value_slice(4), Ok(&buf[..6]));
        assert_eq!(r.head(), Ok(Head::Uint(7)));
    }
}
