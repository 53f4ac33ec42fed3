//! Content addresses for full KV blocks, for automatic prefix caching.
//!
//! A full block's hash chains over its parent's hash, the block's token ids and the model, so
//! equal hashes mean an equal *prefix* (everything before the block too), not just equal tokens:
//! two sequences share a block only if they agree on every token up to its end. Partial blocks
//! have no hash and are never shared.
//!
//! Hashes are 64-bit; a cached block also keeps its parent's hash and its tokens, and a lookup
//! checks both, so a hash collision can at worst miss the cache, never serve the wrong keys.

use std::hash::{DefaultHasher, Hash, Hasher};

use crate::request::CacheSalt;

/// The content address of a full block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// What a cached block must match besides its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Box<[u32]>,
}

/// Hashes of the model's identity, mixed into every block hash so that two models never share.
pub fn model_salt(model_id: &str) -> u64 {
    let mut h = DefaultHasher::new();
    model_id.hash(&mut h);
    h.finish()
}

/// What a sequence's block keys are salted with: the model's salt, and for the blocks past a
/// tenant's shared prefix, the tenant's too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Salts {
    pub model: u64,
    pub tenant: Option<CacheSalt>,
}

impl Salts {
    /// The salt of block `index` (of `block_size` tokens).
    fn of_block(&self, index: usize, block_size: usize) -> u64 {
        match self.tenant {
            Some(tenant) if (index + 1) * block_size > tenant.shared_prefix => {
                let mut h = DefaultHasher::new();
                (self.model, tenant.salt).hash(&mut h);
                h.finish()
            }
            _ => self.model,
        }
    }
}

/// The key of the block holding `tokens` (exactly one block's worth) after `parent`.
pub fn block_key(salt: u64, parent: Option<BlockHash>, tokens: &[u32]) -> BlockKey {
    // DefaultHasher::new() has fixed keys: hashes are stable within and across processes of one
    // build, which is all an in-memory cache needs.
    let mut h = DefaultHasher::new();
    salt.hash(&mut h);
    parent.map(|p| p.0).hash(&mut h);
    tokens.hash(&mut h);
    BlockKey {
        hash: BlockHash(h.finish()),
        parent,
        tokens: tokens.into(),
    }
}

/// Keys of the full blocks of `tokens`, in order, continuing from `known` (keys already
/// computed for the leading blocks).
pub fn extend_keys(salts: Salts, tokens: &[u32], block_size: usize, known: &mut Vec<BlockKey>) {
    let full = tokens.len() / block_size;
    while known.len() < full {
        let i = known.len();
        let parent = known.last().map(|k| k.hash);
        known.push(block_key(
            salts.of_block(i, block_size),
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(salt: u64) -> Salts {
        Salts {
            model: salt,
            tenant: None,
        }
    }

    #[test]
    fn a_tenant_shares_only_its_shared_prefix() {
        let tokens: Vec<u32> = (0..16).collect();
        let keys = |tenant: Option<CacheSalt>| {
            let mut keys = Vec::new();
            let salts = Salts {
                model: model_salt("m"),
                tenant,
            };
            extend_keys(salts, &tokens, 4, &mut keys);
            keys
        };
        let tenant = |salt| {
            Some(CacheSalt {
                salt,
                shared_prefix: 9,
            })
        };
        let (everyone, a, b) = (keys(None), keys(tenant(1)), keys(tenant(2)));
        // Blocks 0 and 1 lie within the 9 shared tokens; block 2 does not.
        assert_eq!(a[..2], everyone[..2]);
        assert_eq!(b[..2], everyone[..2]);
        assert_ne!(a[2].hash, everyone[2].hash);
        assert_ne!(
            a[2].hash, b[2].hash,
            "two tenants never share past the prefix"
        );
        assert_ne!(a[3].hash, b[3].hash);
        assert_eq!(a, keys(tenant(1)), "one tenant finds its own blocks");
    }

    #[test]
    fn hashes_chain_over_the_whole_prefix() {
        let salt = model_salt("m");
        let mut a = Vec::new();
        extend_keys(model(salt), &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, &mut a);
        assert_eq!(a.len(), 2, "only full blocks get keys");
        let mut b = Vec::new();
        extend_keys(model(salt), &[9, 9, 9, 9, 5, 6, 7, 8], 4, &mut b);
        assert_eq!(a[1].tokens, b[1].tokens);
        assert_ne!(
            a[1].hash, b[1].hash,
            "same block tokens after a different prefix"
        );
        let mut c = Vec::new();
        extend_keys(model(model_salt("other")), &[1, 2, 3, 4], 4, &mut c);
        assert_ne!(a[0].hash, c[0].hash, "models never share blocks");
        let mut d = a[..1].to_vec();
        extend_keys(model(salt), &[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut d);
        assert_eq!(a, d, "extending known keys gives the same chain");
    }
}
