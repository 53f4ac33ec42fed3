//! A light guess of the language a text is written in: its script first (Cyrillic, Greek,
//! Arabic, Hebrew, Devanagari, Hangul, kana, Han), then, for Latin script, which language's most
//! common function words it uses most.
//!
//! The guess is made to compare two texts (is the answer in the question's language?), so it
//! prefers saying nothing to guessing: a text with too few function words, or whose two best
//! languages are close, has no guess. It never reads code identifiers as a language of their
//! own: keywords such as `if`, `for` and `not` count as English, which is what code questions
//! are asked in most often.

/// ISO 639-1 codes and each language's most frequent short words (lowercase). A word in several
/// lists counts for each.
const STOPWORDS: &[(&str, &[&str])] = &[
    (
        "en",
        &[
            "the", "and", "is", "are", "to", "of", "in", "it", "you", "that", "this", "for",
            "with", "on", "be", "your", "can", "what", "how", "do", "not", "have", "was", "will",
            "my", "if", "from", "or", "by", "an", "as", "at", "use", "which", "there", "should",
            "would", "does", "i", "we", "they", "their", "then", "when", "than",
        ],
    ),
    (
        "fr",
        &[
            "le", "la", "les", "des", "est", "et", "une", "du", "que", "qui", "pour", "dans",
            "pas", "vous", "je", "sur", "avec", "ce", "il", "sont", "au", "aux", "mon", "ma",
            "mes", "votre", "vos", "comment", "pourquoi", "quel", "quelle", "nous", "mais", "ou",
            "cette", "peut", "être", "plus", "faire", "ne", "de", "en", "un", "à", "sont",
        ],
    ),
    (
        "es",
        &[
            "el", "los", "las", "es", "y", "una", "del", "que", "por", "para", "con", "se", "su",
            "como", "cómo", "qué", "está", "son", "lo", "al", "mi", "puedo", "cuál", "pero", "más",
            "muy", "tu", "sus", "este", "esta", "hay", "también", "usted", "puede", "la", "de",
            "en", "un", "le", "les", "muy", "pero", "sin", "sobre", "entre",
        ],
    ),
    (
        "de",
        &[
            "der", "die", "das", "und", "ist", "nicht", "ich", "ein", "eine", "zu", "mit", "für",
            "auf", "den", "dem", "sie", "wie", "was", "kann", "mein", "meine", "sind", "wird",
            "bei", "auch", "sich", "oder", "aber", "einen", "wenn", "ihre", "ihr", "noch", "nur",
        ],
    ),
    (
        "it",
        &[
            "il", "lo", "gli", "della", "che", "è", "per", "non", "una", "sono", "con", "di",
            "del", "come", "perché", "questo", "questa", "anche", "più", "nel", "alla", "ma", "la",
            "le", "un", "in", "si",
        ],
    ),
    (
        "pt",
        &[
            "o", "os", "as", "é", "um", "uma", "não", "com", "para", "do", "da", "dos", "das",
            "em", "que", "se", "como", "você", "mais", "seu", "sua", "pelo", "pela", "muito", "a",
            "de", "no", "na", "ao",
        ],
    ),
    (
        "nl",
        &[
            "de", "het", "een", "en", "is", "van", "niet", "ik", "dat", "je", "op", "voor", "met",
            "zijn", "hoe", "wat", "ook", "maar", "wordt", "kan", "deze", "naar",
        ],
    ),
];

/// Function words a Latin-script text must use before its language is guessed.
const MIN_HITS: usize = 3;
/// How many times the best language's hits must exceed the runner-up's.
const MIN_LEAD: f32 = 1.5;
/// Share of a text's letters that must be in one non-Latin script for the script to decide.
const MIN_SCRIPT_SHARE: f32 = 0.3;
/// Letters a script needs to name a language: one Greek letter in a formula (`A = πr²`) is
/// not Greek.
const MIN_SCRIPT_LETTERS: usize = 4;

/// The language `text` reads as, when that is clearly not `wanted`: the test for "is this
/// answer in the language asked for". It is bolder than [`guess`], since it only needs to tell
/// that a text is not in one given language: two function words of another language and twice
/// as many as of `wanted` are enough.
pub fn mismatch(wanted: &str, text: &str) -> Option<&'static str> {
    if let Some(script) = script_language(text) {
        return (script != wanted).then_some(script);
    }
    let hits = latin_hits(text);
    let wanted_hits = hits
        .iter()
        .find(|(code, _)| *code == wanted)
        .map_or(0, |(_, n)| *n);
    let (best, best_hits) = hits[0];
    let is_other = best != wanted && best_hits >= MIN_MISMATCH_HITS;
    (is_other && best_hits as f32 >= wanted_hits as f32 * MIN_MISMATCH_LEAD).then_some(best)
}

/// Function words of another language that make a text not `wanted`'s.
const MIN_MISMATCH_HITS: usize = 2;
/// How many times another language's hits must exceed `wanted`'s.
const MIN_MISMATCH_LEAD: f32 = 2.0;

/// The language `text` is most likely written in, as an ISO 639-1 code, or `None` when the text
/// does not say clearly enough.
pub fn guess(text: &str) -> Option<&'static str> {
    script_language(text).or_else(|| latin_language(text, MIN_HITS))
}

/// [`guess`] for a question that an answer is compared with: a question is short ("What does
/// HTTP status code 500 mean?" has two English function words), so two hits name its language
/// when they lead the runner-up as [`guess`]'s do. What reads as a mismatch is still decided by
/// [`mismatch`]'s stricter rule on the answer.
pub fn guess_question(text: &str) -> Option<&'static str> {
    script_language(text).or_else(|| latin_language(text, MIN_QUESTION_HITS))
}

/// Function words that name a question's language (see [`guess_question`]).
const MIN_QUESTION_HITS: usize = 2;

/// Languages that a script alone identifies, when enough of the letters are in it.
fn script_language(text: &str) -> Option<&'static str> {
    let mut letters = 0usize;
    let mut counts = [0usize; 8];
    const CODES: [&str; 8] = ["ru", "el", "ar", "he", "hi", "ko", "ja", "zh"];
    for c in text.chars().filter(|c| c.is_alphabetic()) {
        letters += 1;
        let slot = match c as u32 {
            0x0400..=0x04FF => 0,
            0x0370..=0x03FF => 1,
            0x0600..=0x06FF => 2,
            0x0590..=0x05FF => 3,
            0x0900..=0x097F => 4,
            0xAC00..=0xD7AF | 0x1100..=0x11FF => 5,
            0x3040..=0x30FF => 6,
            0x4E00..=0x9FFF => 7,
            _ => continue,
        };
        counts[slot] += 1;
    }
    if letters == 0 {
        return None;
    }
    // Japanese mixes kana and Han; any real share of kana makes Han text Japanese.
    if counts[6] as f32 >= letters as f32 * 0.1 {
        return Some("ja");
    }
    let (slot, &count) = counts.iter().enumerate().max_by_key(|(_, &n)| n)?;
    (count >= MIN_SCRIPT_LETTERS && count as f32 >= letters as f32 * MIN_SCRIPT_SHARE)
        .then_some(CODES[slot])
}

fn latin_language(text: &str, min_hits: usize) -> Option<&'static str> {
    let hits = latin_hits(text);
    let (best, best_hits) = hits[0];
    let runner_up = hits[1].1;
    (best_hits >= min_hits && best_hits as f32 >= runner_up as f32 * MIN_LEAD).then_some(best)
}

/// Each Latin-script language's function-word count in `text`, most first.
fn latin_hits(text: &str) -> Vec<(&'static str, usize)> {
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    // Only Spanish opens questions and exclamations upside down: each mark counts as a word.
    let inverted = text.chars().filter(|c| matches!(c, '¿' | '¡')).count();
    let mut hits: Vec<(&'static str, usize)> = STOPWORDS
        .iter()
        .map(|(code, list)| {
            let marks = if *code == "es" { inverted } else { 0 };
            (
                *code,
                marks + words.iter().filter(|w| list.contains(w)).count(),
            )
        })
        .collect();
    hits.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_common_latin_languages() {
        assert_eq!(
            guess("How do I reset the password of my account? It is not working."),
            Some("en")
        );
        assert_eq!(
            guess("Pourquoi le ciel est bleu pendant la journée et rouge le soir ?"),
            Some("fr")
        );
        assert_eq!(
            guess("¿Cómo puedo devolver un producto que no me gusta? Es para mi hermano."),
            Some("es")
        );
        assert_eq!(
            guess("Wie kann ich das Passwort für mein Konto ändern? Es ist nicht möglich."),
            Some("de")
        );
    }

    #[test]
    fn guesses_by_script() {
        assert_eq!(guess("Как дела? Всё хорошо."), Some("ru"));
        assert_eq!(guess("今日はいい天気ですね。"), Some("ja"));
        assert_eq!(guess("这是一个测试。"), Some("zh"));
        assert_eq!(guess("A = πr²"), None, "one Greek letter in a formula");
        assert_eq!(guess("Площадь круга: S = πr²"), Some("ru"));
    }

    #[test]
    fn a_question_needs_fewer_function_words() {
        let question = "What does HTTP status code 500 mean?";
        assert_eq!(guess(question), None);
        assert_eq!(guess_question(question), Some("en"));
        // Two languages' words in equal number still name neither.
        assert_eq!(guess_question("the de"), None);
    }

    #[test]
    fn inverted_marks_count_for_spanish() {
        assert_eq!(guess("¿Cuánto es el 25 % de 80?"), Some("es"));
        assert_eq!(guess_question("¡Hola! ¿Qué tal?"), Some("es"));
        // Quoted Spanish in an English question leaves it English.
        assert_eq!(
            guess_question("What does '¿Qué hora es?' mean in English and how do I answer it?"),
            Some("en")
        );
    }

    #[test]
    fn mismatch_needs_another_language_clearly() {
        assert_eq!(
            mismatch("en", "La capital de España es Madrid."),
            Some("es")
        );
        assert_eq!(mismatch("en", "The capital of Spain is Madrid."), None);
        assert_eq!(mismatch("en", "Madrid."), None);
        assert_eq!(mismatch("fr", "Москва."), Some("ru"));
        assert_eq!(mismatch("ru", "Москва — столица России."), None);
    }

    #[test]
    fn says_nothing_when_unsure() {
        assert_eq!(guess(""), None);
        assert_eq!(guess("42"), None);
        assert_eq!(guess("{\"x\": 1, \"y\": [2, 3]}"), None);
        assert_eq!(guess("Paris."), None);
    }
}
