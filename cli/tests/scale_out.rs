//! Gateways and workers as separate processes over the machine's real NATS server: the worker's
//! side of the protocol (bad messages refused without harm, batches, cancels, draining on
//! SIGTERM), and a gateway with two workers taking streaming traffic while one of them is
//! killed and then restarted.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Event, FinishReason, GenerateRequest, Prompt, SamplingParams};
use futures::StreamExt as _;
use protocol::{self, Batch, Cancel, RefusalCode, Reply, Subjects, Submit, VERSION};
use serde_json::{json, Value};
use support::cluster::{self, NATS_URL};

async fn nats() -> async_nats::Client {
    async_nats::connect(NATS_URL)
        .await
        .expect("NATS runs on 127.0.0.1:4222 (`make test` starts it)")
}

/// Sends `payload` as a request to `subject` and reads the worker's reply.
async fn offer(client: &async_nats::Client, subject: &str, payload: Vec<u8>) -> Reply {
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(subject.to_owned(), payload.into()),
    )
    .await
    .expect("the worker answers in time")
    .expect("the worker answers");
    protocol::decode(&reply.payload).expect("a readable reply")
}

/// Offers `submit` on `subject` and returns its stream, once the worker accepted it.
async fn start(
    client: &async_nats::Client,
    subject: &str,
    submit: &Submit,
) -> async_nats::Subscriber {
    let batches = client.subscribe(submit.stream.clone()).await.unwrap();
    let reply = offer(client, subject, encode(submit)).await;
    assert!(matches!(reply, Reply::Accepted { .. }), "{reply:?}");
    batches
}

fn refusal(reply: Reply) -> RefusalCode {
    match reply {
        Reply::Refused { code, .. } => code,
        accepted => panic!("expected a refusal, got {accepted:?}"),
    }
}

fn submit(subjects: &Subjects, id: &str, max_tokens: usize) -> Submit {
    Submit {
        v: VERSION,
        id: id.into(),
        agent: None,
        stream: subjects.stream("testgw", id),
        deadline_ms: Some(60_000),
        request: GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens,
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Text("Count from 1 to 1000:".into()))
        },
    }
}

fn encode(message: &Submit) -> Vec<u8> {
    protocol::encode(message).to_vec()
}

/// Reads a request's batches until its final event; checks they come in order.
async fn read_to_end(batches: &mut async_nats::Subscriber, id: &str) -> (Vec<u32>, Event) {
    let mut tokens = Vec::new();
    let mut seq = 0;
    loop {
        let message = tokio::time::timeout(Duration::from_secs(30), batches.next())
            .await
            .expect("batches keep coming")
            .expect("the subscription is open");
        let batch: Batch = protocol::decode(&message.payload).expect("a readable batch");
        assert_eq!(
            (batch.id.as_str(), batch.seq),
            (id, seq),
            "batches in order"
        );
        seq += 1;
        for event in batch.events {
            match event {
                Event::Delta { tokens: t, .. } => tokens.extend(t),
                end @ Event::Finished { .. } => return (tokens, end),
                Event::PromptLogprobs(_) => panic!("not asked for"),
            }
        }
    }
}

#[tokio::test]
async fn a_worker_refuses_bad_messages_and_stops_on_cancels_lost_readers_and_drains() {
    let name = cluster::cluster("protocol");
    let subjects = Subjects::new(&name).unwrap();
    let mut worker = cluster::worker(&name, "w1", &[]).await;
    let client = nats().await;
    let direct = subjects.worker("w1");

    // Not JSON, another version, a stream subject outside the cluster, a field of the wrong
    // type, and a request the engine can never run: each refused with its own code.
    assert_eq!(
        refusal(offer(&client, &direct, b"{not json".to_vec()).await),
        RefusalCode::InvalidMessage
    );
    let mut future = serde_json::to_value(submit(&subjects, "r0", 4)).unwrap();
    future["v"] = json!(VERSION + 1);
    assert_eq!(
        refusal(offer(&client, &direct, serde_json::to_vec(&future).unwrap()).await),
        RefusalCode::UnsupportedVersion
    );
    let mut elsewhere = submit(&subjects, "r1", 4);
    elsewhere.stream = subjects.agent("coder");
    assert_eq!(
        refusal(offer(&client, &direct, encode(&elsewhere)).await),
        RefusalCode::InvalidMessage
    );
    let mut wrong_type = serde_json::to_value(submit(&subjects, "r2", 4)).unwrap();
    wrong_type["request"]["max_tokens"] = json!("four");
    assert_eq!(
        refusal(offer(&client, &direct, serde_json::to_vec(&wrong_type).unwrap()).await),
        RefusalCode::InvalidMessage
    );
    let mut impossible = submit(&subjects, "r3", 4);
    impossible.request.sampling.top_p = 0.0;
    assert_eq!(
        refusal(offer(&client, &direct, encode(&impossible)).await),
        RefusalCode::InvalidRequest
    );
    // A message with nowhere to answer is dropped.
    client
        .publish(direct.clone(), b"garbage without a reply".to_vec().into())
        .await
        .unwrap();
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "the worker lives"
    );

    // A good request, through the queue subject for requests naming no agent: accepted, then its
    // tokens in ordered batches and one final event whose usage counts them.
    let good = submit(&subjects, "r4", 24);
    let mut batches = client.subscribe(good.stream.clone()).await.unwrap();
    assert_eq!(
        offer(&client, &subjects.any(), encode(&good)).await,
        Reply::Accepted {
            v: VERSION,
            worker: "w1".into()
        }
    );
    let (tokens, end) = read_to_end(&mut batches, "r4").await;
    match end {
        Event::Finished {
            reason: FinishReason::Length,
            usage,
            error: None,
        } => assert_eq!(usage.completion_tokens, tokens.len()),
        other => panic!("{other:?}"),
    }
    assert_eq!(tokens.len(), 24);

    // A cancel stops a long request on the worker.
    let long = submit(&subjects, "r5", 2000);
    let mut batches = start(&client, &direct, &long).await;
    batches.next().await.expect("a first batch");
    let cancel = Cancel {
        v: VERSION,
        id: "r5".into(),
    };
    client
        .publish(subjects.cancel("w1"), protocol::encode(&cancel))
        .await
        .unwrap();
    wait_idle(&worker, "the cancel was ignored").await;

    // A gateway that stops reading without a cancel (it died, or the cancel was lost): the
    // worker's probe finds nobody on the stream and the request stops there too.
    let orphan = submit(&subjects, "r5b", 2000);
    let mut batches = start(&client, &direct, &orphan).await;
    batches.next().await.expect("a first batch");
    batches.unsubscribe().await.unwrap();
    wait_idle(&worker, "the orphaned request ran on").await;

    // SIGTERM while a request runs: it still finishes, the worker leaves the subjects (a new
    // request finds no one), then exits cleanly.
    let last = submit(&subjects, "r6", 48);
    let mut batches = start(&client, &direct, &last).await;
    worker.terminate();
    let (tokens, _) = read_to_end(&mut batches, "r6").await;
    assert_eq!(tokens.len(), 48, "the request in flight finished");
    let after = client
        .request(direct.clone(), encode(&submit(&subjects, "r7", 4)).into())
        .await;
    assert!(after.is_err(), "a drained worker took a request");
    let status = worker.exit_status(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}:\n{}", worker.tail());
}

/// Waits at most 5 s for `worker` to have no request in flight; fails with `why` otherwise.
/// (A 2000-token request runs for far longer.)
async fn wait_idle(worker: &cluster::Process, why: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let health: Value = reqwest::get(worker.url("/health"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if health["in_flight"] == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{why}: {health}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How one streamed request ended, as the client saw it.
#[derive(Debug)]
enum Outcome {
    /// `finish_reason` stop or length, then `[DONE]`.
    Completed,
    /// An error event (`finish_reason: "error"` with an error object) after `tokens` tokens.
    Failed { tokens: usize },
}

/// Streams one chat request through the gateway; panics on anything but a 200 whose stream
/// ends cleanly.
async fn stream(client: &reqwest::Client, url: &str, i: usize) -> Outcome {
    let response = client
        .post(url)
        .json(&json!({
            "model": "default",
            "messages": [{"role": "user", "content": format!("Count from {i} to {}.", i + 50)}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": true,
        }))
        .send()
        .await
        .unwrap_or_else(|e| panic!("request {i}: {e:?}"));
    assert_eq!(response.status(), 200, "request {i}");
    let body = response.text().await.expect("the stream ends");
    let mut tokens = 0;
    let mut finish = None;
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        if choice["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
        {
            tokens += 1;
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = Some((reason.to_owned(), chunk["error"].clone()));
        }
    }
    assert!(done, "request {i}: no [DONE]:\n{body}");
    match finish {
        Some((reason, _)) if reason == "stop" || reason == "length" => Outcome::Completed,
        Some((reason, error)) if reason == "error" => {
            assert!(error["message"].is_string(), "request {i}: {error}");
            Outcome::Failed { tokens }
        }
        other => panic!("request {i}: ended with {other:?}:\n{body}"),
    }
}

#[tokio::test]
async fn a_gateway_survives_losing_a_worker_and_takes_it_back() {
    let name = cluster::cluster("failover");
    let mut w1 = cluster::worker(&name, "w1", &[]).await;
    let w2 = cluster::worker(&name, "w2", &[]).await;
    let mut gateway = cluster::gateway(&name).await;
    gateway.wait_for("/ready", Duration::from_secs(30)).await;
    // Both workers in the gateway's registry view (a few heartbeats).
    tokio::time::sleep(Duration::from_secs(1)).await;

    let url = gateway.url("/v1/chat/completions");
    // Idle connections are dropped before the gateway's header-read timeout (10 s) closes
    // them, so a request is never sent on a connection the gateway is closing at that moment.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(90))
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let (load_client, load_url) = (client.clone(), url.clone());
    let total = 200;
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let load = {
        let done = done.clone();
        tokio::spawn(
            futures::stream::iter(0..total)
                .map(move |i| {
                    let (client, url, done) = (load_client.clone(), load_url.clone(), done.clone());
                    async move {
                        let sent = Instant::now();
                        let outcome = stream(&client, &url, i).await;
                        done.fetch_add(1, Ordering::SeqCst);
                        (sent, sent.elapsed(), outcome)
                    }
                })
                .buffer_unordered(16)
                .collect::<Vec<_>>(),
        )
    };
    // Once 60 requests are done, the first worker dies mid-traffic.
    while done.load(Ordering::SeqCst) < 60 {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the load stalled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w1.kill();
    let killed_at = Instant::now();
    let outcomes = load.await.expect("the load ran");
    let elapsed = started.elapsed();

    let mut tally = BTreeMap::new();
    for (sent, took, outcome) in &outcomes {
        assert!(
            *took < Duration::from_secs(60),
            "a request took {took:?}: no request may hang"
        );
        match outcome {
            Outcome::Completed => *tally.entry("completed").or_insert(0) += 1,
            Outcome::Failed { tokens } => {
                // Only a request the dead worker had already started streaming may fail; one
                // that had not must have been handed to the survivor.
                assert!(*tokens > 0, "a request failed before its first token");
                assert!(
                    *sent < killed_at,
                    "a request sent after the kill failed: {outcome:?}"
                );
                *tally.entry("failed mid-stream").or_insert(0) += 1;
            }
        }
    }
    eprintln!("{total} streams in {elapsed:?}: {tally:?}");
    assert_eq!(outcomes.len(), total);
    assert!(tally["completed"] >= total - 16, "{tally:?}");

    // The survivor served the rest.
    assert!(w2.metric("swarmgate_generation_tokens_total").await > 0.0);
    assert!(gateway.metric("swarmgate_generation_tokens_total").await > 0.0);

    // The first worker comes back under its name and takes traffic again.
    let w1 = cluster::worker(&name, "w1", &[]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let again: Vec<Outcome> = futures::stream::iter(0..16)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            async move { stream(&client, &url, 1000 + i).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(
        again.iter().all(|o| matches!(o, Outcome::Completed)),
        "{again:?}"
    );
    let rejoined = w1.metric("swarmgate_generation_tokens_total").await;
    assert!(
        rejoined > 0.0,
        "the restarted worker took no traffic:\n{}\n---\n{}",
        w1.tail(),
        gateway.tail()
    );
}

/// A stand-in worker on `subjects` named `id`: registers with `in_flight` as its load, accepts
/// every request sent to it in the name of `accepts_as` (its own, unless it lies) and answers
/// with `script` (its batches' events, then silence). Returns how many requests it has accepted
/// so far.
async fn fake_worker(
    client: &async_nats::Client,
    subjects: &Subjects,
    (id, accepts_as): (&str, &str),
    in_flight: usize,
    script: Vec<Vec<Event>>,
) -> Arc<AtomicUsize> {
    let store = protocol::workers::bucket(client.clone(), subjects, Duration::from_secs(30))
        .await
        .unwrap();
    let beat = protocol::Heartbeat {
        v: VERSION,
        worker: id.into(),
        models: vec![testkit::MODEL_ID.into()],
        agents: vec![],
        running: 0,
        waiting: 0,
        in_flight,
        free_kv_blocks: 100,
        warm: vec![],
    };
    // Listen before registering, as a real worker does: the gateway may pick it at once.
    let mut requests = client.subscribe(subjects.worker(id)).await.unwrap();
    client.flush().await.unwrap();
    store.put(id, protocol::encode(&beat)).await.unwrap();
    let (client, id) = (client.clone(), accepts_as.to_owned());
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Some(message) = requests.next().await {
            let submit: Submit = protocol::decode(&message.payload).unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let reply = Reply::Accepted {
                v: VERSION,
                worker: id.clone(),
            };
            client
                .publish(message.reply.unwrap(), protocol::encode(&reply))
                .await
                .unwrap();
            for (seq, events) in script.iter().enumerate() {
                let batch = Batch {
                    v: VERSION,
                    id: submit.id.clone(),
                    seq: seq as u64,
                    events: events.clone(),
                };
                client
                    .publish(submit.stream.clone(), protocol::encode(&batch))
                    .await
                    .unwrap();
            }
        }
    });
    accepted
}

fn delta(text: &str) -> Event {
    Event::Delta {
        text: text.into(),
        tokens: vec![42],
        logprobs: vec![],
    }
}

/// The gateway's NATS transport on `subjects`, once its registry shows a live worker.
async fn gateway_transport(subjects: &Subjects) -> gateway::transport::Nats {
    use gateway::transport::{nats::Settings, Nats, Transport};

    let model =
        engine::ModelInfo::load(&testkit::models().join(format!("{}.gguf", testkit::MODEL_ID)))
            .unwrap();
    let settings = Settings {
        subjects: subjects.clone(),
        accept_timeout: Duration::from_secs(2),
        stream_timeout: Duration::from_secs(1),
        registry_ttl: Duration::from_secs(30),
        attempts: 3,
    };
    let transport = Nats::connect(nats().await, vec![model], settings)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !transport.is_ready() {
        assert!(
            Instant::now() < deadline,
            "the registry never showed the workers"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    transport
}

#[tokio::test]
async fn the_gateway_hands_over_a_request_whose_worker_went_silent_before_its_first_token() {
    use gateway::transport::Transport;

    let subjects = Subjects::new(&cluster::cluster("handover")).unwrap();
    let client = nats().await;
    let finished = Event::Finished {
        reason: FinishReason::Stop,
        usage: engine::Usage {
            prompt_tokens: 3,
            completion_tokens: 1,
            cached_tokens: 0,
        },
        error: None,
    };
    // The least loaded worker sends only a keepalive, then nothing; the next one answers.
    // (Registered in this order, so a registry the transport has seen only in part holds the
    // silent one.)
    let silent = fake_worker(&client, &subjects, ("silent", "silent"), 0, vec![vec![]]).await;
    let good = fake_worker(
        &client,
        &subjects,
        ("good", "good"),
        5,
        vec![vec![delta("hi"), finished.clone()]],
    )
    .await;
    let transport = gateway_transport(&subjects).await;
    let request = GenerateRequest::new(Prompt::Tokens(vec![1, 2, 3]));
    let events: Vec<Event> = transport
        .submit(None, request.clone())
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(events, [delta("hi"), finished]);
    assert_eq!(
        (silent.load(Ordering::SeqCst), good.load(Ordering::SeqCst)),
        (1, 1),
        "the least loaded worker first, then the other"
    );

    // A worker that dies after its first token cannot be replaced: the stream ends with an
    // error event instead. (Its own cluster, so that the transport has surely seen it.)
    let subjects = Subjects::new(&cluster::cluster("midanswer")).unwrap();
    let _half = fake_worker(
        &client,
        &subjects,
        ("half", "half"),
        0,
        vec![vec![delta("par")]],
    )
    .await;
    let transport = gateway_transport(&subjects).await;
    let events: Vec<Event> = transport
        .submit(None, request)
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(events.len(), 2, "{events:?}");
    match &events[1] {
        Event::Finished {
            reason: FinishReason::Error,
            usage,
            error: Some(error),
        } => {
            assert!(error.contains("mid-answer"), "{error}");
            assert_eq!(usage.completion_tokens, 1);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn an_acceptance_in_another_workers_name_is_refused_and_the_request_goes_elsewhere() {
    use gateway::transport::Transport;

    let subjects = Subjects::new(&cluster::cluster("impostor")).unwrap();
    let client = nats().await;
    let finished = Event::Finished {
        reason: FinishReason::Stop,
        usage: engine::Usage {
            prompt_tokens: 3,
            completion_tokens: 1,
            cached_tokens: 0,
        },
        error: None,
    };
    // The least loaded worker answers on its own subject in the name of another, and would
    // stream something else; the request must not take its stream.
    let mut cancels = client.subscribe(subjects.cancel("honest")).await.unwrap();
    let liar = fake_worker(
        &client,
        &subjects,
        ("liar", "honest"),
        0,
        vec![vec![delta("forged"), finished.clone()]],
    )
    .await;
    let honest = fake_worker(
        &client,
        &subjects,
        ("honest", "honest"),
        5,
        vec![vec![delta("hi"), finished.clone()]],
    )
    .await;
    let transport = gateway_transport(&subjects).await;
    let events: Vec<Event> = transport
        .submit(None, GenerateRequest::new(Prompt::Tokens(vec![1, 2, 3])))
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(events, [delta("hi"), finished]);
    assert_eq!(
        (liar.load(Ordering::SeqCst), honest.load(Ordering::SeqCst)),
        (1, 1),
        "offered to the liar first, then to the honest worker"
    );
    // The request the liar claimed is cancelled in the name it gave.
    let cancel = tokio::time::timeout(Duration::from_secs(5), cancels.next())
        .await
        .expect("a cancel for the forged acceptance")
        .unwrap();
    protocol::decode::<Cancel>(&cancel.payload).expect("a cancel");
}

#[tokio::test]
async fn a_second_worker_under_a_live_workers_id_exits_with_a_clear_message() {
    let name = cluster::cluster("twins");
    let _first = cluster::worker(&name, "twin", &[]).await;
    let mut second = cluster::spawn_worker(NATS_URL, &name, "twin", &[], &[]);
    let status = second.exit_status(Duration::from_secs(60)).await;
    assert!(!status.success(), "the second worker ran");
    // The whole log: a backtrace may follow the message.
    let log = std::fs::read_to_string(&second.log).unwrap();
    assert!(
        log.contains("Error: a worker named \"twin\" is already live"),
        "{log}"
    );
}

#[tokio::test]
async fn a_workers_metrics_and_health_take_the_gateways_keys() {
    let name = cluster::cluster("keys");
    let mut worker =
        cluster::spawn_worker(NATS_URL, &name, "w1", &["--api-key", "sk-worker-key"], &[]);
    // The probe orchestrators call needs no key.
    worker.wait_for("/ready", Duration::from_secs(120)).await;
    let client = reqwest::Client::new();
    for path in ["/metrics", "/health"] {
        for key in [None, Some("sk-wrong")] {
            let mut request = client.get(worker.url(path));
            if let Some(key) = key {
                request = request.bearer_auth(key);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 401, "{path} with {key:?}");
            let body: Value = response.json().await.unwrap();
            assert!(body["error"]["message"].is_string(), "{body}");
        }
        let response = client
            .get(worker.url(path))
            .bearer_auth("sk-worker-key")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path} with the key");
    }
}

/// A worker started as a device of the plan (`--place-on`) loads the models and hosts the
/// agents placed there: with room for both, SmolLM2 and Gemma 3 in one engine. It advertises
/// both, and a gateway given the same models sends a request naming Gemma, and one for the agent
/// on Gemma, to it.
#[tokio::test]
async fn a_worker_takes_its_share_of_the_plan_and_serves_both_models() {
    const GEMMA3: &str = "gemma-3-270m-q4_k_m";
    let root = testkit::root();
    let shipped = std::fs::read_to_string(root.join("swarm.toml")).unwrap();
    // `math`'s model line is the first after its name.
    let (before, after) = shipped.split_at(shipped.find("name = \"math\"").unwrap());
    let after = after.replacen("model = \"default\"", &format!("model = \"{GEMMA3}\""), 1);
    let swarm = format!("{before}{after}");
    let file = std::env::temp_dir().join(format!("swarmgate-plan-{}.toml", std::process::id()));
    std::fs::write(&file, swarm).unwrap();
    let file = file.to_str().unwrap();
    let name = cluster::cluster("plan");
    let placed = [
        "--place-on",
        "cpu",
        "--plan-devices",
        "cpu=4GiB",
        "--swarm",
        file,
    ];
    let worker = cluster::worker(&name, "planned", &placed).await;
    let gemma = format!("models/{GEMMA3}.gguf");
    let env = [
        ("SWARMGATE_EXTRA_MODELS", gemma.as_str()),
        ("SWARMGATE_SWARM", file),
    ];
    let mut gateway = cluster::spawn_gateway(NATS_URL, &name, &env);
    gateway.wait_for("/ready", Duration::from_secs(120)).await;
    let client = reqwest::Client::new();
    let models: Value = (client.get(gateway.url("/v1/models")).send().await.unwrap())
        .json()
        .await
        .unwrap();
    let ids = testkit::calls::ids(&models);
    assert_eq!(ids[..2], [testkit::MODEL_ID, GEMMA3], "{models}");
    assert!(ids.contains(&"math"), "{models}");
    // Gemma 3's GGUF is its base model: it answers after one example exchange.
    let one_shot = json!([
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "What is the capital of France?"},
    ]);
    // Tokens the worker's engine decoded with Gemma so far, from its metrics.
    let decoded = || async {
        let text = (client.get(worker.url("/metrics")).send().await.unwrap())
            .text()
            .await
            .unwrap();
        let series = format!("swarmgate_model_decode_tokens_total{{model=\"{GEMMA3}\"}} ");
        let line = text.lines().find(|l| l.starts_with(&series));
        line.map_or(0, |l| l[series.len()..].trim().parse::<u64>().unwrap())
    };
    let chat = |model: &'static str| {
        let body = json!({"model": model, "messages": one_shot, "max_tokens": 8, "temperature": 0});
        let request = client.post(gateway.url("/v1/chat/completions")).json(&body);
        async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            let body: Value = response.json().await.unwrap();
            assert_eq!(status, 200, "{model}: {body}");
            body
        }
    };
    let body = chat(GEMMA3).await;
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{body}");
    // `math` runs on Gemma (its tutoring prompt is more than the base model can follow: what it
    // says is beside the point here, where it ran is not).
    let before = decoded().await;
    let body = chat("math").await;
    assert_eq!(body["swarm"]["agent"], "math", "{body}");
    let generated = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(generated > 0);
    // Each attempt's first token comes from its prefill; the rest are decoded.
    let attempts = (body["swarm"]["usage"].as_array().unwrap().iter())
        .filter(|hop| hop["hop"] == "generate")
        .count() as u64;
    let after = decoded().await;
    assert_eq!(
        after - before,
        generated - attempts,
        "math ran on another model"
    );
    let log = std::fs::read_to_string(&worker.log).unwrap();
    assert!(log.contains("taking the plan's share"), "{log}");
    let _ = std::fs::remove_file(file);
}
