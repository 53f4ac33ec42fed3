//! The fixed texts of the shared-prefix workload: six specialist agents, each with a long
//! system prompt (in `prompts/`), short one-off questions, and one scripted conversation.
//!
//! Fixed text, so that every run of the benchmark sends the same prompts; the system prompts are
//! real instructions of a few hundred tokens, like the agents a gateway serves, because filler
//! would tokenize and cache unlike real prompts.

/// One agent: who it is and what its users ask.
pub(super) struct AgentScript {
    pub system: &'static str,
    /// Single-turn questions, asked in order.
    pub questions: &'static [&'static str],
    /// The user turns of one conversation, each sent after the previous turn's answer.
    pub conversation: &'static [&'static str],
}

pub(super) const AGENTS: [AgentScript; 6] = [
    AgentScript {
        system: include_str!("prompts/coding.txt"),
        questions: &[
            "Why does the borrow checker reject pushing to a Vec while I hold a reference to its first element?",
            "My Python script reads a 2 GB CSV with pandas and runs out of memory. What can I do?",
            "What is the difference between Arc<Mutex<T>> and RwLock for a read-heavy cache?",
            "How do I make an HTTP request time out after 5 seconds with reqwest?",
            "Is it safe to hold a std::sync::Mutex guard across an .await point?",
            "How should I structure error types in a Rust library crate?",
            "My TypeScript build says 'Object is possibly undefined' on a Map lookup. How do I fix it cleanly?",
            "What is a good way to retry a flaky network call with exponential backoff?",
            "Review this SQL: \"SELECT * FROM users WHERE name = '\" + name + \"'\". Anything wrong?",
            "How do I write a table-driven test for a function that parses durations like '5m' and '2h'?",
            "Why is my async Rust service slow when I call a blocking file read inside a handler?",
            "When should I use a HashMap versus a BTreeMap?",
        ],
        conversation: &[
            "I need a function that splits a list of log lines into batches of at most 1 MB each. Can you write it in Rust?",
            "Good. What happens if a single line is larger than 1 MB?",
            "Let's reject such lines with an error instead. Please update the function.",
            "Now add a unit test for the oversized line case.",
        ],
    },
    AgentScript {
        system: include_str!("prompts/math.txt"),
        questions: &[
            "How do I solve 3x + 7 = 22?",
            "What does the derivative of a function actually tell me?",
            "Why is any number to the power zero equal to one?",
            "How do I find the area of a triangle with sides 5, 6 and 7?",
            "What is the difference between permutations and combinations?",
            "Can you explain what a logarithm is with an example?",
            "How do I factorise x^2 - 5x + 6?",
            "What is the probability of rolling two sixes with two dice?",
            "Why can't we divide by zero?",
            "How do I convert 0.375 into a fraction?",
            "What is the chain rule, in simple words?",
            "How do I find the inverse of a 2 by 2 matrix?",
        ],
        conversation: &[
            "I have to integrate x times e^x and I don't know where to start.",
            "Why do we pick u = x and not u = e^x?",
            "I got x e^x - e^x. Do I need to add anything?",
        ],
    },
    AgentScript {
        system: include_str!("prompts/support.txt"),
        questions: &[
            "How long does delivery to Germany take?",
            "Can I return a duvet I opened but never used?",
            "My order HH-20481377 hasn't arrived after a week. What should I do?",
            "Do you ship to the United Kingdom?",
            "How much is express delivery?",
            "The lamp I received flickers. Can I get a replacement?",
            "When will I get my refund for the plates I sent back?",
            "Is delivery free if my order is exactly 50 euros?",
            "Can I change the delivery address after ordering?",
            "How do I book a delivery slot for the sofa I ordered?",
            "Do I pay for return shipping if I simply changed my mind?",
            "Which payment methods do you accept?",
        ],
        conversation: &[
            "Hi, I received the wrong size of bed sheets in order HH-31877420.",
            "The card ends in 4417. I ordered king size but got double.",
            "Do I have to pay to send them back?",
            "OK, and how soon will the right ones arrive?",
        ],
    },
    AgentScript {
        system: include_str!("prompts/analyst.txt"),
        questions: &[
            "Our conversion rate went from 2.1% to 2.4% after the redesign. Is that significant?",
            "Write a SQL query for monthly active users from an events table.",
            "Should I use the mean or the median for delivery times?",
            "What chart should I use to show revenue by region over the last year?",
            "How do I compute week-over-week growth in a spreadsheet?",
            "What is sample ratio mismatch and how do I check for it?",
            "Our average order value rose but total revenue fell. How can that happen?",
            "How long should an A/B test run?",
            "What is the difference between correlation and causation, with a business example?",
            "How do I find duplicate customers in a table by email in SQL?",
            "What is a cohort retention table and how do I read one?",
            "Why might a dashboard metric jump on the first day of a month?",
        ],
        conversation: &[
            "I want to know which marketing channel brings our most valuable customers.",
            "We have an orders table and a customers table with a signup_channel column.",
            "Can you write the SQL for 90-day revenue per customer by channel?",
            "How should I present the result to the marketing team?",
        ],
    },
    AgentScript {
        system: include_str!("prompts/travel.txt"),
        questions: &[
            "Is it better to take the train or fly from Paris to Amsterdam?",
            "What should we see in Lisbon in two days?",
            "Which area of Barcelona is good for a family with small children?",
            "Is there a night train from Vienna to Venice?",
            "When is the best time of year to hike in the Dolomites?",
            "We have 800 euros each for a week in Portugal. Is that realistic?",
            "What is a relaxed itinerary for three days in Rome?",
            "How do I get from Copenhagen to Stockholm by train?",
            "Are museums in Paris closed on Mondays or Tuesdays?",
            "What should I pack for a city break in Prague in December?",
            "Is the Swiss Travel Pass worth it for five days?",
            "Which Greek island is quiet in early June?",
        ],
        conversation: &[
            "We are two adults and a six-year-old, planning five days in Berlin in October.",
            "Our budget is about 1500 euros in total, not counting travel to Berlin.",
            "Can you give us a day-by-day plan?",
        ],
    },
    AgentScript {
        system: include_str!("prompts/writer.txt"),
        questions: &[
            "How should I structure the README for a small command-line tool?",
            "What makes a good error message?",
            "Should API docs list every configuration option or only the common ones?",
            "How do I write release notes that users actually read?",
            "What belongs in a runbook for an on-call engineer?",
            "How long should a design document be?",
            "Is it better to write 'click' or 'select' in UI instructions?",
            "How do I document a breaking change in an HTTP API?",
            "What is the difference between a tutorial and a how-to guide?",
            "How do I make a long configuration reference easier to scan?",
            "Should code comments and documentation say the same thing?",
            "How do I write a good first sentence for a README?",
        ],
        conversation: &[
            "Here is my README intro: 'This project is a tool which can be used for various purposes related to logs.' How can I improve it?",
            "It tails log files, filters them with regular expressions and sends matches to Slack.",
            "Now suggest the headings for the rest of the README.",
        ],
    },
];
