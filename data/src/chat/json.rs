//! JSON as chat templates see and print it. Templates run in Python's Jinja on what `json.loads`
//! made: objects in the order their keys were written, integers with every digit, other numbers
//! the nearest f64; `tojson` is `json.dumps` (`", "` and `": "` between items, non-ASCII kept,
//! floats as Python's `repr`), and a tool declaration goes through `dictsort` (keys sorted
//! without regard to case, ties in written order) with `,` and `:`.
//!
//! Why not serde_json's `Value`: it keeps the written order and every digit only behind its
//! `preserve_order` and `arbitrary_precision` features, which change JSON for every crate in the
//! build, and its default float parsing can miss the nearest f64 in the last digit (17 significant
//! digits): a tool call's numbers would change on their way into training text. [`Json::parse`]
//! is the small parser that keeps all three; the printers are Python's rules.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use std::collections::HashMap;
use std::fmt;

/// A JSON value as Python's `json.loads` reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Array(Vec<Json>),
    /// Keys in the order written; a repeated key keeps its first place and its last value.
    Object(Vec<(String, Json)>),
}

/// A number: an integer (its digits; Python's ints have no bound) or a float.
#[derive(Clone, Debug)]
pub enum Number {
    Int(String),
    Float(f64),
}

impl PartialEq for Number {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Number::Int(a), Number::Int(b)) => a == b,
            (Number::Float(a), Number::Float(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

impl Eq for Number {}

impl fmt::Display for Number {
    /// As Python prints it: an int's digits, a float's `repr`.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Number::Int(digits) => f.write_str(digits),
            Number::Float(x) => f.write_str(&python_float(*x)),
        }
    }
}

/// Python's `repr` of a float: the shortest digits that read back to it, positional for
/// exponents from -4 to 15 (`0.0001`, `1000000000000000.0`), else `1e-05`, `1.5e+16`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip digits too: `4.337023190940196e2`, `-0e0`.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` writes an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits = mantissa.replace('.', "");
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let whole = exp as usize + 1;
            if digits.len() <= whole {
                format!("{digits}{}.0", "0".repeat(whole - digits.len()))
            } else {
                format!("{}.{}", &digits[..whole], &digits[whole..])
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let m = match digits.len() {
            1 => digits,
            _ => format!("{}.{}", &digits[..1], &digits[1..]),
        };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{body}")
}

impl Json {
    /// Reads JSON text as Python's `json.loads` does (see [`Json`]).
    pub fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            at: 0,
        };
        let value = p.value(0)?;
        p.space();
        match p.at == p.s.len() {
            true => Ok(value),
            false => Err(p.error("trailing characters")),
        }
    }

    /// The value under `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// `json.dumps(value, ensure_ascii=False)`: Python's default separators, keys in order.
    pub fn python_dumps(&self) -> String {
        let mut out = String::new();
        self.print(&mut out, ", ", ": ", false);
        out
    }

    /// A tool declaration as K3's template prints it (its `json_sorted` macro): every object's
    /// keys sorted as Jinja's `dictsort` sorts them (lower-cased, ties as written), `,` and `:`.
    pub fn sorted_compact(&self) -> String {
        let mut out = String::new();
        self.print(&mut out, ",", ":", true);
        out
    }

    fn print(&self, out: &mut String, item: &str, key: &str, sorted: bool) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&n.to_string()),
            Json::String(s) => out.push_str(&quoted(s)),
            Json::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item);
                    }
                    v.print(out, item, key, sorted);
                }
                out.push(']');
            }
            Json::Object(entries) => {
                let mut entries: Vec<&(String, Json)> = entries.iter().collect();
                if sorted {
                    // Stable: keys equal but for case stay in written order, as `sorted` keeps them.
                    entries.sort_by_key(|(k, _)| k.to_lowercase());
                }
                out.push('{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(item);
                    }
                    out.push_str(&quoted(k));
                    out.push_str(key);
                    v.print(out, item, key, sorted);
                }
                out.push('}');
            }
        }
    }
}

/// A string as `json.dumps(s, ensure_ascii=False)` quotes it: the same escapes as serde_json's
/// (`\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control characters as `\u00xx`).
fn quoted(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// How deep arrays and objects may nest (serde_json's limit).
const MAX_DEPTH: usize = 128;

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> String {
        format!("invalid JSON at byte {}: {what}", self.at)
    }

    fn space(&mut self) {
        while self.s.get(self.at).is_some_and(|b| b" \t\n\r".contains(b)) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.space();
        let hit = self.s.get(self.at) == Some(&byte);
        self.at += usize::from(hit);
        hit
    }

    fn value(&mut self, depth: usize) -> Result<Json, String> {
        if depth > MAX_DEPTH {
            return Err(self.error("nested too deeply"));
        }
        self.space();
        let rest = &self.s[self.at..];
        for (word, value) in [
            ("null", Json::Null),
            ("true", Json::Bool(true)),
            ("false", Json::Bool(false)),
        ] {
            if rest.starts_with(word.as_bytes()) {
                self.at += word.len();
                return Ok(value);
            }
        }
        match rest.first() {
            Some(b'"') => self.string().map(Json::String),
            Some(b'[') => {
                self.at += 1;
                let mut items = Vec::new();
                if self.eat(b']') {
                    return Ok(Json::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if self.eat(b']') {
                        return Ok(Json::Array(items));
                    }
                    if !self.eat(b',') {
                        return Err(self.error("expected `,` or `]`"));
                    }
                }
            }
            Some(b'{') => {
                self.at += 1;
                let mut entries: Vec<(String, Json)> = Vec::new();
                let mut places: HashMap<String, usize> = HashMap::new();
                if self.eat(b'}') {
                    return Ok(Json::Object(entries));
                }
                loop {
                    self.space();
                    if self.s.get(self.at) != Some(&b'"') {
                        return Err(self.error("expected a key"));
                    }
                    let key = self.string()?;
                    if !self.eat(b':') {
                        return Err(self.error("expected `:`"));
                    }
                    let value = self.value(depth + 1)?;
                    match places.get(&key) {
                        Some(&i) => entries[i].1 = value,
                        None => {
                            places.insert(key.clone(), entries.len());
                            entries.push((key, value));
                        }
                    }
                    if self.eat(b'}') {
                        return Ok(Json::Object(entries));
                    }
                    if !self.eat(b',') {
                        return Err(self.error("expected `,` or `}`"));
                    }
                }
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.error("expected a value")),
        }
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`: an int's digits, or the nearest f64
    /// (Rust's `str::parse` rounds correctly).
    fn number(&mut self) -> Result<Json, String> {
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.s.get(p.at).is_some_and(u8::is_ascii_digit) {
                p.at += 1;
            }
            p.at - from
        };
        self.at += usize::from(self.s[self.at] == b'-');
        let whole = digits(self);
        if whole == 0 || (whole > 1 && self.s[self.at - whole] == b'0') {
            return Err(self.error("a malformed number"));
        }
        let mut float = false;
        if self.s.get(self.at) == Some(&b'.') {
            self.at += 1;
            float = true;
            if digits(self) == 0 {
                return Err(self.error("a malformed number"));
            }
        }
        if matches!(self.s.get(self.at), Some(b'e' | b'E')) {
            self.at += 1;
            float = true;
            if matches!(self.s.get(self.at), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if digits(self) == 0 {
                return Err(self.error("a malformed number"));
            }
        }
        let text = std::str::from_utf8(&self.s[start..self.at]).expect("ASCII");
        Ok(Json::Number(match float {
            true => Number::Float(text.parse().expect("a JSON number parses")),
            // Python's int of "-0" is 0.
            false if text == "-0" => Number::Int("0".into()),
            false => Number::Int(text.into()),
        }))
    }

    fn string(&mut self) -> Result<String, String> {
        self.at += 1;
        let mut out = String::new();
        loop {
            let run = self.at;
            while self
                .s
                .get(self.at)
                .is_some_and(|&b| b != b'"' && b != b'\\' && b >= 0x20)
            {
                self.at += 1;
            }
            out.push_str(
                std::str::from_utf8(&self.s[run..self.at]).map_err(|_| self.error("not UTF-8"))?,
            );
            match self.s.get(self.at) {
                Some(b'"') => {
                    self.at += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.at += 1;
                    let escaped = self.s.get(self.at).copied();
                    self.at += 1;
                    out.push(match escaped {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => self.unicode()?,
                        _ => return Err(self.error("an unknown escape")),
                    });
                }
                Some(_) => return Err(self.error("a control character in a string")),
                None => return Err(self.error("an unterminated string")),
            }
        }
    }

    /// The character of `\uXXXX` (after the `u`), a surrogate pair's when it opens one.
    fn unicode(&mut self) -> Result<char, String> {
        let hex = |p: &mut Self| -> Result<u32, String> {
            let code =
                p.s.get(p.at..p.at + 4)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u32::from_str_radix(h, 16).ok())
                    .ok_or_else(|| p.error("a malformed \\u escape"))?;
            p.at += 4;
            Ok(code)
        };
        let first = hex(self)?;
        let code = match first {
            0xD800..=0xDBFF if self.s[self.at..].starts_with(b"\\u") => {
                self.at += 2;
                let low = hex(self)?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(self.error("a lone surrogate"));
                }
                0x10000 + ((first - 0xD800) << 10) + (low - 0xDC00)
            }
            _ => first,
        };
        char::from_u32(code).ok_or_else(|| self.error("a lone surrogate"))
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

/// Reads what another parser made (its floats as it read them: [`Json::parse`] reads text).
struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
        Ok(Json::Number(Number::Int(n.to_string())))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
        Ok(Json::Number(Number::Int(n.to_string())))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Json, E> {
        Ok(Json::Number(Number::Float(x)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.into()))
    }

    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut entries: Vec<(String, Json)> = Vec::new();
        let mut places: HashMap<String, usize> = HashMap::new();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            match places.get(&key) {
                Some(&i) => entries[i].1 = value,
                None => {
                    places.insert(key.clone(), entries.len());
                    entries.push((key, value));
                }
            }
        }
        Ok(Json::Object(entries))
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Number(Number::Int(digits)) => match digits.parse::<i64>() {
                Ok(n) => s.serialize_i64(n),
                Err(_) => match digits.parse::<u64>() {
                    Ok(n) => s.serialize_u64(n),
                    Err(_) => Err(serde::ser::Error::custom(format!(
                        "the integer {digits} is beyond 64 bits"
                    ))),
                },
            },
            Json::Number(Number::Float(x)) => s.serialize_f64(*x),
            Json::String(x) => s.serialize_str(x),
            Json::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(entries) => {
                let mut map = s.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_keep_their_order_and_numbers_print_as_python_does() {
        let v = Json::parse(
            r#"{"b": 1, "a": [true, null, 2.5, "é\n\u00e9\ud83d\ude00"], "b": 3, "c": -0,
                "d": [433.70231909401963, 1e-05, 1E-7, 0.0001, 1e16, 123456789012345678.0,
                      1e15, -0.0, 18446744073709551616, 1.5e300, 1e400]}"#,
        )
        .unwrap();
        assert_eq!(
            v.python_dumps(),
            "{\"b\": 3, \"a\": [true, null, 2.5, \"é\\n\u{e9}\u{1F600}\"], \"c\": 0, \"d\": \
             [433.70231909401963, 1e-05, 1e-07, 0.0001, 1e+16, 1.2345678901234568e+17, \
             1000000000000000.0, -0.0, 18446744073709551616, 1.5e+300, Infinity]}"
        );
    }

    #[test]
    fn malformed_text_is_refused_with_its_place() {
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\" 1}",
            "01",
            "1.",
            "-",
            "\"\\x\"",
            "\"a\nb\"",
            "\"\\ud800\"",
            "[] x",
            "tru",
        ] {
            let e = Json::parse(bad).unwrap_err();
            assert!(e.starts_with("invalid JSON at byte "), "{bad:?}: {e}");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(
            Json::parse(&deep)
                .unwrap_err()
                .contains("nested too deeply")
        );
    }

    #[test]
    fn declarations_sort_keys_without_regard_to_case_ties_as_written() {
        let v = Json::parse(r#"{"b": {"Z": 1, "a": [1, {"y": 0, "X": 0}]}, "A": "\"q\"", "B": 2}"#)
            .unwrap();
        assert_eq!(
            v.sorted_compact(),
            r#"{"A":"\"q\"","b":{"a":[1,{"X":0,"y":0}],"Z":1},"B":2}"#
        );
    }
}
