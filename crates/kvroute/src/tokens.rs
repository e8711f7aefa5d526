//! Parsing token-id lists given on the command line.
//!
//! Owns: the `--tokens` syntax: comma-separated ids and `a..b` ranges (`0..40,7,7`), or
//! `@FILE` holding the same syntax or a JSON array.
//! Must not: panic on any input; every error names the offending item.

use anyhow::{bail, Context, Result};

pub fn parse_tokens(spec: &str) -> Result<Vec<u32>> {
    if let Some(path) = spec.strip_prefix('@') {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let trimmed = text.trim();
        if trimmed.starts_with('[') {
            return serde_json::from_str(trimmed)
                .with_context(|| format!("{path}: not a JSON array of token ids"));
        }
        return parse_tokens(trimmed);
    }
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if let Some((a, b)) = item.split_once("..") {
            let a: u32 = a
                .trim()
                .parse()
                .with_context(|| format!("bad range start in {item:?}"))?;
            let b: u32 = b
                .trim()
                .parse()
                .with_context(|| format!("bad range end in {item:?}"))?;
            if b < a || (b - a) > 10_000_000 {
                bail!("bad range {item:?}");
            }
            out.extend(a..b);
        } else {
            out.push(
                item.parse()
                    .with_context(|| format!("bad token id {item:?}"))?,
            );
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_lists_mix() {
        assert_eq!(parse_tokens("0..3, 7,7").unwrap(), vec![0, 1, 2, 7, 7]);
        assert!(parse_tokens("1,x").is_err());
        assert!(parse_tokens("5..2").is_err());
    }
}
