//! The engine generations kvroute predicts, and the rules that differ between them.
//!
//! Owns: `Engine` (vLLM 0.32, vLLM 0.33), its names (`vllm-0.32`, `vllm-0.33`) and detection
//! from the version string a worker's `GET /version` reports; `Speculative`, the fields of
//! vLLM's `--speculative-config` that change prefix caching, with what each generation derives
//! from them (whether matches drop the EAGLE block, 0.33's `num_hash_lookahead_tokens`); and
//! `Rules`, what one worker's prediction applies: the lookahead count `L` and the drop.
//! Invariants: on vLLM 0.32 `L` is 0 and the rules are 0.32's; on 0.33 an `L > 0` means no
//! group drops (the lookahead hash proves the boundary token instead), and `L = 0` is 0.32's
//! drop rule. The facts come from the vLLM 0.32 and 0.33 sources (docs/engines.md).
//! Must not: hold state, read files or talk to engines (the gateway asks `/version`).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A vLLM generation whose prefix-cache rules the index reproduces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Engine {
    /// vLLM 0.32: legacy block hashes; with EAGLE-style speculation matches drop a block.
    #[default]
    #[serde(rename = "vllm-0.32")]
    Vllm032,
    /// vLLM 0.33: with EAGLE-style speculation block hashes cover the next `L` tokens
    /// (lookahead hashes) and nothing drops, unless lookahead hashes are disabled.
    #[serde(rename = "vllm-0.33")]
    Vllm033,
}

impl Engine {
    /// Every supported generation, oldest first.
    pub const ALL: &'static [Engine] = &[Engine::Vllm032, Engine::Vllm033];

    /// The configuration name (`vllm-0.32`, `vllm-0.33`).
    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm032 => "vllm-0.32",
            Engine::Vllm033 => "vllm-0.33",
        }
    }

    /// The generation of a vLLM version string (`0.33.0`, `0.32.1rc2`, `0.33.0+cu129`,
    /// optionally `v`-prefixed): its major and minor numbers. `None` for any other release.
    pub fn from_version(version: &str) -> Option<Engine> {
        let v = version.trim();
        let v = v.strip_prefix('v').unwrap_or(v);
        let mut parts = v.split('.');
        let major = parts.next()?;
        let minor: String = parts
            .next()?
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        match (major, minor.as_str()) {
            ("0", "32") => Some(Engine::Vllm032),
            ("0", "33") => Some(Engine::Vllm033),
            _ => None,
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Engine::ALL
            .iter()
            .copied()
            .find(|e| e.name() == s)
            .ok_or_else(|| format!("unknown engine {s:?} (expected vllm-0.32 or vllm-0.33)"))
    }
}

/// The fields of vLLM's `--speculative-config` JSON that change prefix caching, under vLLM's
/// names (the engine's whole JSON is accepted: its other fields are ignored).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Speculative {
    /// `method`: `eagle`, `eagle3`, `mtp` (or a model-specific MTP name such as
    /// `deepseek_mtp`, which vLLM rewrites to `mtp`), `dflash`, `dspark`, `draft_model`,
    /// `ngram`, `suffix`, …
    pub method: String,
    /// `num_speculative_tokens` (k).
    pub num_speculative_tokens: u32,
    /// The draft model's `num_nextn_predict_layers` (MTP; vLLM's default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_nextn_predict_layers: Option<u32>,
    /// `disable_lookahead_block_hashes` (0.33): legacy hashes and the drop instead.
    #[serde(default)]
    pub disable_lookahead_block_hashes: bool,
    /// `disable_eagle_block_drop`: neither the drop nor (0.33) lookahead hashes.
    #[serde(default)]
    pub disable_eagle_block_drop: bool,
}

impl Speculative {
    /// The method as vLLM runs it: every MTP model name is `mtp`.
    pub fn method(&self) -> &str {
        if self.method == "mtp" || self.method.ends_with("_mtp") {
            "mtp"
        } else {
            &self.method
        }
    }

    /// vLLM's `use_eagle()`: drafting from the target model's hidden states.
    fn uses_eagle(&self) -> bool {
        matches!(
            self.method(),
            "eagle" | "eagle3" | "mtp" | "dflash" | "dspark"
        )
    }

    /// vLLM's `use_eagle_block_drop()` on `engine`: 0.32 drops for every EAGLE-style method,
    /// 0.33 no longer for DFlash and DSpark (their draft KV does not read the next token).
    pub fn drops_eagle_block(&self, engine: Engine) -> bool {
        let needs = match engine {
            Engine::Vllm032 => self.uses_eagle(),
            Engine::Vllm033 => self.uses_eagle() && !matches!(self.method(), "dflash" | "dspark"),
        };
        needs && !self.disable_eagle_block_drop
    }

    /// Whether `engine` flags KV cache groups as holding the drafter's layers
    /// (`is_eagle_group`): 0.33 marks every draft layer's spec; 0.32 only the group of the last
    /// registered layer for `mtp`, and a `non_causal_multi_token_decode` spec (`dspark`). With
    /// none flagged the coordinator drops in every group and the `OffloadingConnector` pops no
    /// chunk. (0.32 also flags the last layer's group of DeepSeek V4 models, which the
    /// configuration does not name.)
    pub fn flags_drafter_groups(&self, engine: Engine) -> bool {
        match engine {
            Engine::Vllm032 => matches!(self.method(), "mtp" | "dspark"),
            Engine::Vllm033 => true,
        }
    }

    /// vLLM 0.33's `num_hash_lookahead_tokens` for an engine with prefix caching and no KV
    /// connector (any `--kv-transfer-config` keeps it 0): 0 without the drop or with
    /// `disable_lookahead_block_hashes`; `num_speculative_tokens` for multi-module MTP (a draft
    /// with at least two next-n layers and k ≥ 2); else 1. Always 0 on 0.32.
    pub fn hash_lookahead_tokens(&self, engine: Engine) -> u32 {
        if engine != Engine::Vllm033
            || !self.drops_eagle_block(engine)
            || self.disable_lookahead_block_hashes
        {
            return 0;
        }
        let layers = self.num_nextn_predict_layers.unwrap_or(1);
        if self.method() == "mtp" && layers.min(self.num_speculative_tokens) > 1 {
            self.num_speculative_tokens
        } else {
            1
        }
    }
}

/// The rules one worker's prediction applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    /// Lookahead tokens each block hash covers (vLLM 0.33's `num_hash_lookahead_tokens`; 0 on
    /// 0.32): a block `[s, e)` of an `n`-token request has a hash only when `e + L ≤ n`, and a
    /// hit is at most `⌊(n − max(1, L)) / A⌋ · A`.
    pub lookahead: u32,
    /// Matches drop the EAGLE block (vLLM 0.32's rule; on 0.33 only without lookahead).
    pub eagle_drop: bool,
}

impl Rules {
    /// The rules of `engine` for a worker configured with the EAGLE drop (`eagle`) and `L`
    /// lookahead tokens (ignored on 0.32).
    pub fn of(engine: Engine, eagle: bool, hash_lookahead_tokens: u32) -> Rules {
        let lookahead = match engine {
            Engine::Vllm032 => 0,
            Engine::Vllm033 => hash_lookahead_tokens,
        };
        Rules {
            lookahead,
            eagle_drop: eagle && lookahead == 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(method: &str, k: u32, layers: Option<u32>) -> Speculative {
        Speculative {
            method: method.into(),
            num_speculative_tokens: k,
            num_nextn_predict_layers: layers,
            disable_lookahead_block_hashes: false,
            disable_eagle_block_drop: false,
        }
    }

    #[test]
    fn version_strings_name_their_generation() {
        for (v, want) in [
            ("0.32.0", Some(Engine::Vllm032)),
            ("0.32.1rc2", Some(Engine::Vllm032)),
            ("v0.33.0", Some(Engine::Vllm033)),
            ("0.33.0+cu129", Some(Engine::Vllm033)),
            ("0.33rc1.dev5", Some(Engine::Vllm033)),
            ("0.31.0", None),
            ("0.330.0", None),
            ("1.33.0", None),
            ("", None),
        ] {
            assert_eq!(Engine::from_version(v), want, "{v:?}");
        }
        assert_eq!("vllm-0.33".parse::<Engine>(), Ok(Engine::Vllm033));
        assert!("vllm-0.34".parse::<Engine>().is_err());
        assert_eq!(
            serde_json::to_string(&Engine::Vllm032).ok().as_deref(),
            Some("\"vllm-0.32\"")
        );
    }

    /// The table of docs/engines.md (vLLM 0.33 `VllmConfig.num_hash_lookahead_tokens`).
    #[test]
    fn lookahead_counts_follow_vllm_0_33_s_methods() {
        let e = Engine::Vllm033;
        assert_eq!(spec("eagle", 3, None).hash_lookahead_tokens(e), 1);
        assert_eq!(spec("eagle3", 5, None).hash_lookahead_tokens(e), 1);
        assert_eq!(spec("mtp", 3, None).hash_lookahead_tokens(e), 1);
        assert_eq!(spec("mtp", 1, Some(3)).hash_lookahead_tokens(e), 1);
        assert_eq!(spec("mtp", 4, Some(2)).hash_lookahead_tokens(e), 4);
        assert_eq!(spec("deepseek_mtp", 2, Some(2)).hash_lookahead_tokens(e), 2);
        for method in ["dflash", "dspark", "draft_model", "ngram", "suffix"] {
            assert_eq!(
                spec(method, 3, None).hash_lookahead_tokens(e),
                0,
                "{method}"
            );
        }
        let mut off = spec("eagle", 3, None);
        off.disable_lookahead_block_hashes = true;
        assert_eq!(off.hash_lookahead_tokens(e), 0);
        assert!(off.drops_eagle_block(e), "legacy hashes and the drop");
        off.disable_eagle_block_drop = true;
        assert!(!off.drops_eagle_block(e));
        // 0.32: no lookahead, and DFlash/DSpark still drop.
        assert_eq!(
            spec("eagle", 3, None).hash_lookahead_tokens(Engine::Vllm032),
            0
        );
        assert!(spec("dflash", 3, None).drops_eagle_block(Engine::Vllm032));
        assert!(!spec("dflash", 3, None).drops_eagle_block(Engine::Vllm033));
        assert!(!spec("ngram", 3, None).drops_eagle_block(Engine::Vllm032));
    }

    #[test]
    fn lookahead_turns_the_drop_off_only_on_0_33() {
        assert_eq!(
            Rules::of(Engine::Vllm032, true, 1),
            Rules {
                lookahead: 0,
                eagle_drop: true
            }
        );
        assert_eq!(
            Rules::of(Engine::Vllm033, true, 1),
            Rules {
                lookahead: 1,
                eagle_drop: false
            }
        );
        assert_eq!(
            Rules::of(Engine::Vllm033, true, 0),
            Rules {
                lookahead: 0,
                eagle_drop: true
            }
        );
    }
}
