//! A small MessagePack reader and writer: just what engine KV events use, with the guards an
//! untrusted decoder needs (bounded nesting, no allocation sized by a length the bytes cannot
//! back, every read checked).

use crate::WireError;

/// Deepest nesting accepted (KV events nest four levels; garbage may nest thousands).
const MAX_DEPTH: usize = 32;

/// Most values one message may decode into. Each costs up to 48 bytes decoded for as little as
/// one byte on the wire (a nil), so a frame of nils would otherwise grow fifty-fold; a
/// batch of 10,000 blocks of 64 token ids stays well within it.
pub const MAX_VALUES: usize = 1 << 20;

/// A decoded MessagePack value. Integers keep their full range (u64 and i64 both fit i128).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    /// An array whose items are all integers (token ids, block hashes), read without a `Value`
    /// per item: the hot path of every KV event.
    Ints(Vec<i128>),
    Map(Vec<(Value, Value)>),
    /// An extension type, kept opaque.
    Ext(i8, Vec<u8>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The items of an array of integers, however it was read.
    pub fn as_ints(&self) -> Option<Vec<i128>> {
        match self {
            Self::Ints(v) => Some(v.clone()),
            Self::Array(a) => a.iter().map(Value::as_int).collect(),
            _ => None,
        }
    }

    /// Whether this is an array (of any items).
    pub fn is_array(&self) -> bool {
        matches!(self, Self::Array(_) | Self::Ints(_))
    }

    pub fn as_int(&self) -> Option<i128> {
        match self {
            Self::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Self::Nil)
    }

    /// The value under a string key of a map.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Self::Map(entries) => {
                entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
            }
            _ => None,
        }
    }

    /// As JSON, for handing to serde (map keys that are not strings are written as strings).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Self::Nil | Self::Ext(..) => J::Null,
            Self::Bool(b) => J::Bool(*b),
            Self::Int(i) => match (u64::try_from(*i), i64::try_from(*i)) {
                (Ok(u), _) => J::from(u),
                (_, Ok(s)) => J::from(s),
                _ => J::Null,
            },
            Self::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            Self::Str(s) => J::String(s.clone()),
            Self::Bin(b) => J::Array(b.iter().map(|&x| J::from(x)).collect()),
            Self::Array(a) => J::Array(a.iter().map(Value::to_json).collect()),
            Self::Ints(v) => J::Array(v.iter().map(|&i| Self::Int(i).to_json()).collect()),
            Self::Map(m) => J::Object(
                m.iter()
                    .map(|(k, v)| {
                        let key = match k {
                            Self::Str(s) => s.clone(),
                            other => other.to_json().to_string(),
                        };
                        (key, v.to_json())
                    })
                    .collect(),
            ),
        }
    }
}

/// Decodes exactly one value from `bytes` (trailing bytes are an error).
pub fn decode(bytes: &[u8]) -> Result<Value, WireError> {
    let mut reader = Reader { bytes, pos: 0, values_left: MAX_VALUES };
    let value = reader.value(0)?;
    if reader.pos != bytes.len() {
        return Err(WireError::Msgpack("trailing bytes after the value"));
    }
    Ok(value)
}

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pub(crate) pos: usize,
    values_left: usize,
}

/// Typed reads for decoders that know their shape (`vllm_fast`): each reads one value of the
/// kind it names, counted against [`MAX_VALUES`] exactly as [`decode`] counts it, and returns
/// `None`, having moved nowhere that matters, when the next value is not of that kind or the
/// input ends (the caller then decodes the whole message the general way).
impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0, values_left: MAX_VALUES }
    }

    pub(crate) fn at_end(&self) -> bool {
        self.pos == self.bytes.len()
    }

    fn counted(&mut self) -> Option<()> {
        self.values_left = self.values_left.checked_sub(1)?;
        Some(())
    }

    /// An array's length (its items follow).
    pub(crate) fn array_len(&mut self) -> Option<usize> {
        let n = match *self.bytes.get(self.pos)? {
            m @ 0x90..=0x9f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                self.len(2).ok()?
            }
            0xdd => {
                self.pos += 1;
                self.len(4).ok()?
            }
            _ => return None,
        };
        self.counted()?;
        self.count(n, 1).ok()
    }

    /// A map's number of entries (keys and values follow, alternating).
    pub(crate) fn map_len(&mut self) -> Option<usize> {
        let n = match *self.bytes.get(self.pos)? {
            m @ 0x80..=0x8f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xde => {
                self.pos += 1;
                self.len(2).ok()?
            }
            0xdf => {
                self.pos += 1;
                self.len(4).ok()?
            }
            _ => return None,
        };
        self.counted()?;
        self.count(n, 2).ok()
    }

    pub(crate) fn str_ref(&mut self) -> Option<&'a str> {
        let n = match *self.bytes.get(self.pos)? {
            m @ 0xa0..=0xbf => {
                self.pos += 1;
                usize::from(m & 0x1f)
            }
            m @ 0xd9..=0xdb => {
                self.pos += 1;
                self.len(1 << (m - 0xd9)).ok()?
            }
            _ => return None,
        };
        self.counted()?;
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len())?;
        let s = std::str::from_utf8(&self.bytes[self.pos..end]).ok()?;
        self.pos = end;
        Some(s)
    }

    pub(crate) fn int(&mut self) -> Option<i128> {
        let m = *self.bytes.get(self.pos)?;
        if !is_int_marker(m) {
            return None;
        }
        self.pos += 1;
        self.counted()?;
        let v = match m {
            0x00..=0x7f => i128::from(m),
            0xe0..=0xff => i128::from(m as i8),
            0xcc => i128::from(self.byte().ok()?),
            0xcd => i128::from(u16::from_be_bytes(self.be().ok()?)),
            0xce => i128::from(u32::from_be_bytes(self.be().ok()?)),
            0xcf => i128::from(u64::from_be_bytes(self.be().ok()?)),
            0xd0 => i128::from(self.byte().ok()? as i8),
            0xd1 => i128::from(i16::from_be_bytes(self.be().ok()?)),
            0xd2 => i128::from(i32::from_be_bytes(self.be().ok()?)),
            _ => i128::from(i64::from_be_bytes(self.be().ok()?)),
        };
        Some(v)
    }

    /// An array of `n` integers (its header read), each made a `u64` by `conv`, appended to
    /// `out`; `None` at the first item that is not an integer or that `conv` refuses. One
    /// tight loop: token ids are most of a KV event's bytes.
    pub(crate) fn ints_into(
        &mut self,
        n: usize,
        out: &mut Vec<u64>,
        conv: impl Fn(i128) -> Option<u64>,
    ) -> Option<()> {
        self.values_left = self.values_left.checked_sub(n)?;
        out.reserve(n);
        let bytes = self.bytes;
        let mut pos = self.pos;
        for _ in 0..n {
            let m = *bytes.get(pos)?;
            let (v, width) = match m {
                0x00..=0x7f => (i128::from(m), 0),
                0xcc => (i128::from(*bytes.get(pos + 1)?), 1),
                0xcd => (
                    i128::from(u16::from_be_bytes(bytes.get(pos + 1..pos + 3)?.try_into().ok()?)),
                    2,
                ),
                0xce => (
                    i128::from(u32::from_be_bytes(bytes.get(pos + 1..pos + 5)?.try_into().ok()?)),
                    4,
                ),
                0xcf => (
                    i128::from(u64::from_be_bytes(bytes.get(pos + 1..pos + 9)?.try_into().ok()?)),
                    8,
                ),
                0xe0..=0xff => (i128::from(m as i8), 0),
                0xd0 => (i128::from(*bytes.get(pos + 1)? as i8), 1),
                0xd1 => (
                    i128::from(i16::from_be_bytes(bytes.get(pos + 1..pos + 3)?.try_into().ok()?)),
                    2,
                ),
                0xd2 => (
                    i128::from(i32::from_be_bytes(bytes.get(pos + 1..pos + 5)?.try_into().ok()?)),
                    4,
                ),
                0xd3 => (
                    i128::from(i64::from_be_bytes(bytes.get(pos + 1..pos + 9)?.try_into().ok()?)),
                    8,
                ),
                _ => return None,
            };
            out.push(conv(v)?);
            pos += 1 + width;
        }
        self.pos = pos;
        Some(())
    }

    /// A nil, consumed if it is next.
    pub(crate) fn nil(&mut self) -> Option<bool> {
        if self.bytes.get(self.pos) != Some(&0xc0) {
            return Some(false);
        }
        self.pos += 1;
        self.counted()?;
        Some(true)
    }

    /// A float; `None`, with nothing read, for anything else or a truncated one (so a caller
    /// may try another kind at the same place).
    pub(crate) fn float(&mut self) -> Option<f64> {
        let width = match *self.bytes.get(self.pos)? {
            0xca => 4,
            0xcb => 8,
            _ => return None,
        };
        if self.bytes.len() - self.pos <= width {
            return None;
        }
        self.pos += 1;
        self.counted()?;
        match width {
            4 => Some(f64::from(f32::from_be_bytes(self.be().ok()?))),
            _ => Some(f64::from_be_bytes(self.be().ok()?)),
        }
    }

    /// Any one value, the general way, nested `depth` deep in the message.
    pub(crate) fn any(&mut self, depth: usize) -> Option<Value> {
        self.value(depth).ok()
    }
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or(WireError::Msgpack("truncated input"))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len(&mut self, width: usize) -> Result<usize, WireError> {
        Ok(match width {
            1 => usize::from(self.byte()?),
            2 => usize::from(u16::from_be_bytes(self.be()?)),
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    /// A count of items that each take at least one byte: more than remain is a lie.
    fn count(&mut self, n: usize, per_item: usize) -> Result<usize, WireError> {
        if n.saturating_mul(per_item) > self.bytes.len() - self.pos {
            return Err(WireError::Msgpack("length larger than the input"));
        }
        Ok(n)
    }

    fn str(&mut self, n: usize) -> Result<Value, WireError> {
        let raw = self.take(n)?;
        let s = std::str::from_utf8(raw).map_err(|_| WireError::Msgpack("string is not UTF-8"))?;
        Ok(Value::Str(s.to_owned()))
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, WireError> {
        let n = self.count(n, 1)?;
        if n > 0 && self.bytes.get(self.pos).is_some_and(|&m| is_int_marker(m)) {
            let start = self.pos;
            let mut ints = Vec::with_capacity(n);
            for _ in 0..n {
                match self.bytes.get(self.pos) {
                    Some(&m) if is_int_marker(m) => match self.value(depth + 1)? {
                        Value::Int(i) => ints.push(i),
                        _ => unreachable!("an integer marker reads an integer"),
                    },
                    _ => break,
                }
            }
            if ints.len() == n {
                return Ok(Value::Ints(ints));
            }
            self.pos = start; // mixed items: read them the general way
        }
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, WireError> {
        let n = self.count(n, 2)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let v = self.value(depth + 1)?;
            entries.push((k, v));
        }
        Ok(Value::Map(entries))
    }

    fn ext(&mut self, n: usize) -> Result<Value, WireError> {
        let kind = self.byte()? as i8;
        Ok(Value::Ext(kind, self.take(n)?.to_vec()))
    }

    fn value(&mut self, depth: usize) -> Result<Value, WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::Msgpack("nested too deeply"));
        }
        self.values_left =
            self.values_left.checked_sub(1).ok_or(WireError::Msgpack("too many values"))?;
        let marker = self.byte()?;
        Ok(match marker {
            0x00..=0x7f => Value::Int(i128::from(marker)),
            0x80..=0x8f => return self.map(usize::from(marker & 0x0f), depth),
            0x90..=0x9f => return self.array(usize::from(marker & 0x0f), depth),
            0xa0..=0xbf => return self.str(usize::from(marker & 0x1f)),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (marker - 0xc4))?;
                Value::Bin(self.take(n)?.to_vec())
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (marker - 0xc7))?;
                return self.ext(n);
            }
            0xca => Value::Float(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Value::Float(f64::from_be_bytes(self.be()?)),
            0xcc => Value::Int(i128::from(self.byte()?)),
            0xcd => Value::Int(i128::from(u16::from_be_bytes(self.be()?))),
            0xce => Value::Int(i128::from(u32::from_be_bytes(self.be()?))),
            0xcf => Value::Int(i128::from(u64::from_be_bytes(self.be()?))),
            0xd0 => Value::Int(i128::from(self.byte()? as i8)),
            0xd1 => Value::Int(i128::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Value::Int(i128::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Value::Int(i128::from(i64::from_be_bytes(self.be()?))),
            0xd4..=0xd8 => return self.ext(1 << (marker - 0xd4)),
            0xd9..=0xdb => {
                let n = self.len(1 << (marker - 0xd9))?;
                return self.str(n);
            }
            0xdc | 0xdd => {
                let n = self.len(if marker == 0xdc { 2 } else { 4 })?;
                return self.array(n, depth);
            }
            0xde | 0xdf => {
                let n = self.len(if marker == 0xde { 2 } else { 4 })?;
                return self.map(n, depth);
            }
            0xe0..=0xff => Value::Int(i128::from(marker as i8)),
            0xc1 => return Err(WireError::Msgpack("reserved marker 0xc1")),
        })
    }
}

fn is_int_marker(m: u8) -> bool {
    matches!(m, 0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff)
}

/// Appends MessagePack to a buffer, choosing the shortest form as msgspec does.
#[derive(Debug, Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    pub fn bool(&mut self, b: bool) {
        self.buf.push(if b { 0xc3 } else { 0xc2 });
    }

    pub fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.buf.push(v as u8),
            0x80..=0xff => self.buf.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                self.buf.push(0xcd);
                self.buf.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.buf.push(0xce);
                self.buf.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                self.buf.push(0xcf);
                self.buf.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            return self.uint(v as u64);
        }
        match v {
            -32..=-1 => self.buf.push(v as i8 as u8),
            -128..=-33 => self.buf.extend_from_slice(&[0xd0, v as i8 as u8]),
            -32768..=-129 => {
                self.buf.push(0xd1);
                self.buf.extend_from_slice(&(v as i16).to_be_bytes());
            }
            -2_147_483_648..=-32769 => {
                self.buf.push(0xd2);
                self.buf.extend_from_slice(&(v as i32).to_be_bytes());
            }
            _ => {
                self.buf.push(0xd3);
                self.buf.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    pub fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        match n {
            0..=31 => self.buf.push(0xa0 | n as u8),
            32..=0xff => self.buf.extend_from_slice(&[0xd9, n as u8]),
            0x100..=0xffff => {
                self.buf.push(0xda);
                self.buf.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                self.buf.push(0xdb);
                self.buf.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    pub fn array(&mut self, n: usize) {
        self.header(n, 0x90, 0xdc);
    }

    pub fn map(&mut self, n: usize) {
        self.header(n, 0x80, 0xde);
    }

    /// A map header in the 16-bit form even when a smaller one would do (msgspec sizes a
    /// struct's header by its field count before omitting defaults: vLLM's `BlockStored`).
    pub fn map16(&mut self, n: u16) {
        self.buf.push(0xde);
        self.buf.extend_from_slice(&n.to_be_bytes());
    }

    fn header(&mut self, n: usize, fix: u8, wide: u8) {
        if n < 16 {
            self.buf.push(fix | n as u8);
        } else if n <= 0xffff {
            self.buf.push(wide);
            self.buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.buf.push(wide + 1);
            self.buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn round_trips_and_refusals() {
        let mut w = Writer::default();
        w.array(5);
        w.uint(u64::MAX);
        w.int(-5_210_000_000_000_000_000);
        w.str("GPU");
        w.nil();
        w.map(1);
        w.str("k");
        w.f64(1.5);
        let v = decode(&w.buf).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!(a[0], Value::Int(i128::from(u64::MAX)));
        assert_eq!(a[1], Value::Int(-5_210_000_000_000_000_000));
        assert_eq!(a[4].get("k"), Some(&Value::Float(1.5)));
        assert!(decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err(), "a 4G-element array in 5 bytes");
        assert!(decode(&[0x91; 100]).is_err(), "too deep");
        assert!(decode(&[0xc1]).is_err());
        assert!(decode(&[0x01, 0x02]).is_err(), "trailing bytes");
    }

    /// A frame of nils: one byte each on the wire, tens decoded. Past `MAX_VALUES` it is
    /// refused rather than grown fifty-fold.
    #[test]
    fn values_per_message_are_bounded() {
        let frame = |n: usize| {
            let mut w = Writer::default();
            w.array(n);
            w.buf.resize(w.buf.len() + n, 0xc0);
            w.buf
        };
        assert!(decode(&frame(MAX_VALUES - 1)).is_ok(), "the array and its items");
        assert!(matches!(decode(&frame(MAX_VALUES)), Err(WireError::Msgpack("too many values"))));
    }

    proptest! {
        #[test]
        fn never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn integers_round_trip(u in any::<u64>(), i in any::<i64>()) {
            let mut w = Writer::default();
            w.array(2);
            w.uint(u);
            w.int(i);
            let v = decode(&w.buf).unwrap();
            prop_assert_eq!(v.as_ints(), Some(vec![i128::from(u), i128::from(i)]));
        }
    }
}
