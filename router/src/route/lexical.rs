//! Lexical similarity for the `embedding` strategy: TF-IDF vectors of character n-grams.
//!
//! MiniLM reads English; the words it has never seen (most of a French or German request, code
//! identifiers, product names) come out as fragments that carry little meaning, so two requests
//! in the same language look alike whatever they ask. Character n-grams see what the encoder
//! misses: shared stems across a language's inflections ("rembours" in "remboursement" and
//! "remboursé"), cognates across languages ("factur" in invoice words of four languages), and
//! the literal tokens of a domain (`SQL`, `git`, `%`, `x^2`). Each text becomes the counts of its
//! 3- to 5-character substrings (lowercased, whitespace runs as one space, one space at each
//! end), weighted by `1 + ln(count)` times the n-gram's inverse document frequency over the
//! anchors, and normalised; the similarity of two texts is the dot product of their vectors.
//! This is the sparse half of the hybrid retrieval that search engines run beside dense
//! embeddings: each half catches what the other misses.
//!
//! Cost: building the vectors of a few hundred anchors takes a millisecond or two; a request's
//! vector and its dot products with every anchor, well under a millisecond.

use std::collections::{BTreeMap, HashMap};

/// The n-gram lengths, in characters.
const SHORTEST: usize = 3;
const LONGEST: usize = 5;

/// A text's normalised TF-IDF vector: (n-gram id, weight) sorted by id. N-grams that no anchor
/// has count towards the norm but are left out, since no anchor can match them.
#[derive(Debug, Default)]
pub struct NgramVector(Vec<(u32, f32)>);

impl NgramVector {
    /// The cosine similarity of two normalised vectors.
    pub fn dot(&self, other: &NgramVector) -> f32 {
        let (mut a, mut b) = (self.0.iter().peekable(), other.0.iter().peekable());
        let mut sum = 0.0;
        while let (Some(&&(i, x)), Some(&&(j, y))) = (a.peek(), b.peek()) {
            match i.cmp(&j) {
                std::cmp::Ordering::Less => drop(a.next()),
                std::cmp::Ordering::Greater => drop(b.next()),
                std::cmp::Ordering::Equal => {
                    sum += x * y;
                    a.next();
                    b.next();
                }
            }
        }
        sum
    }
}

/// The n-grams of one set of texts (the anchors of a registry snapshot) and their inverse
/// document frequencies.
#[derive(Debug, Default)]
pub struct NgramIdf {
    ids: HashMap<String, u32>,
    /// By id.
    idf: Vec<f32>,
    /// The weight of an n-gram no anchor has: the rarest possible.
    unseen: f32,
}

impl NgramIdf {
    /// Smoothed IDF over `texts`: `ln((1 + N) / (1 + df)) + 1`.
    pub fn fit<'a>(texts: impl IntoIterator<Item = &'a str>) -> Self {
        let mut documents = 0usize;
        let mut ids = HashMap::new();
        let mut frequency: Vec<usize> = Vec::new();
        for text in texts {
            documents += 1;
            for gram in ngram_counts(text).into_keys() {
                let next = ids.len() as u32;
                let id = *ids.entry(gram).or_insert(next);
                if id == next {
                    frequency.push(0);
                }
                frequency[id as usize] += 1;
            }
        }
        let n = documents as f32;
        let idf = frequency
            .into_iter()
            .map(|df| ((1.0 + n) / (1.0 + df as f32)).ln() + 1.0)
            .collect();
        Self {
            ids,
            idf,
            unseen: (1.0 + n).ln() + 1.0,
        }
    }

    /// `text`'s normalised TF-IDF vector (empty for a text of no n-gram).
    pub fn vector(&self, text: &str) -> NgramVector {
        let mut norm = 0.0f32;
        let mut weights: Vec<(u32, f32)> = Vec::new();
        for (gram, count) in ngram_counts(text) {
            let id = self.ids.get(&gram).copied();
            let idf = id.map_or(self.unseen, |id| self.idf[id as usize]);
            let weight = (1.0 + (count as f32).ln()) * idf;
            norm += weight * weight;
            weights.extend(id.map(|id| (id, weight)));
        }
        let norm = norm.sqrt();
        if norm > 0.0 {
            weights.iter_mut().for_each(|(_, w)| *w /= norm);
        }
        weights.sort_unstable_by_key(|&(id, _)| id);
        NgramVector(weights)
    }

    /// The weight of `gram` (its IDF).
    #[cfg(test)]
    fn weight(&self, gram: &str) -> f32 {
        self.ids
            .get(gram)
            .map_or(self.unseen, |&id| self.idf[id as usize])
    }
}

/// How often each 3- to 5-character substring occurs in `text`, lowercased, with whitespace runs
/// as one space and a space at each end (so that word starts and ends are n-grams too). Ordered,
/// so that ids and sums come out the same for the same texts, bit for bit.
fn ngram_counts(text: &str) -> BTreeMap<String, usize> {
    let mut chars = vec![' '];
    for word in text.split_whitespace() {
        chars.extend(word.chars().flat_map(char::to_lowercase));
        chars.push(' ');
    }
    let mut counts = BTreeMap::new();
    for n in SHORTEST..=LONGEST {
        for window in chars.windows(n) {
            *counts.entry(window.iter().collect()).or_default() += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngrams_are_lowercased_padded_and_whitespace_blind() {
        let counts = ngram_counts("Ab\t  C");
        // " ab c " has 4 trigrams, 3 four-grams and 2 five-grams.
        assert_eq!(counts.values().sum::<usize>(), 4 + 3 + 2);
        assert_eq!(counts.get(" ab"), Some(&1));
        assert_eq!(counts.get("ab c "), Some(&1));
        assert_eq!(ngram_counts("ab c"), counts);
        assert!(ngram_counts("").is_empty());
    }

    #[test]
    fn vectors_are_unit_and_identical_texts_score_one() {
        let idf = NgramIdf::fit(["refund my order", "sql join query", "poem about rain"]);
        let v = idf.vector("Refund my ORDER");
        assert!((v.dot(&v) - 1.0).abs() < 1e-5);
        assert!((v.dot(&idf.vector("refund my order")) - 1.0).abs() < 1e-5);
        assert_eq!(idf.vector("").dot(&v), 0.0);
        // A text of n-grams no anchor has matches nothing, and its own weights still normalise
        // the ones that do match.
        assert_eq!(idf.vector("xyzzy").dot(&v), 0.0);
        let partial = idf.vector("refund xyzzy");
        assert!(partial.dot(&partial) < 1.0);
        assert!(partial.dot(&v) > 0.0);
    }

    #[test]
    fn shared_stems_score_above_unrelated_text_and_rare_grams_weigh_more() {
        let anchors = [
            "Je voudrais être remboursé de ma commande",
            "Écris un poème sur la mer",
            "Calcule la dérivée de la fonction",
        ];
        let idf = NgramIdf::fit(anchors);
        let vectors: Vec<_> = anchors.iter().map(|a| idf.vector(a)).collect();
        let query = idf.vector("Quand vais-je recevoir mon remboursement ?");
        let scores: Vec<f32> = vectors.iter().map(|v| query.dot(v)).collect();
        assert!(scores[0] > scores[1] && scores[0] > scores[2], "{scores:?}");
        // " la " is in every anchor, "rembo" in one: the rarer n-gram weighs more.
        assert!(idf.weight(" la ") < idf.weight("rembo"));
    }
}
