//! `swarmgate loadgen` end to end: the binary loads a real server (in process, on the real
//! model, on 127.0.0.1) streaming and not, and its report, chart and table say what happened;
//! against a port nobody listens on and a server that never answers, it counts the failures by
//! kind instead.

use std::path::PathBuf;
use std::process::Command;

use gateway::config::DEFAULT_MAX_BODY_BYTES;
use gateway::AppState;
use serde_json::Value;
use testkit::{engine, generating};

/// A real server on an ephemeral port, stopped when the test's runtime ends.
async fn server() -> String {
    let addr = testkit::serve(AppState::new(engine().clone(), DEFAULT_MAX_BODY_BYTES)).await;
    format!("http://{addr}")
}

/// What one run of `swarmgate loadgen` left: the JSON report, the chart's bytes, the table.
struct Run {
    report: Value,
    png: Vec<u8>,
    table: String,
}

/// Runs `swarmgate loadgen --url URL ARGS`, writing into a directory of its own named `name`.
async fn loadgen(name: &str, url: &str, args: &[&str]) -> Run {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("loadgen-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let (out, png) = (dir.join("report.json"), dir.join("chart.png"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_swarmgate"));
    command
        .args(["loadgen", "--url", url])
        .args(args)
        .arg("--out")
        .arg(&out)
        .arg("--png")
        .arg(&png);
    // Blocking, off the runtime: the server under load runs on it.
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "loadgen failed: {stderr}");
    Run {
        report: serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap(),
        png: std::fs::read(&png).unwrap(),
        table: String::from_utf8(output.stdout).unwrap(),
    }
}

fn assert_png(png: &[u8]) {
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        png.len() > 10_000,
        "a {} byte chart draws nothing",
        png.len()
    );
}

fn ms(summary: &Value, key: &str) -> f64 {
    summary[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} in {summary}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_plain_levels_are_measured() {
    let _engine = generating().await;
    let url = server().await;
    for stream in [true, false] {
        let mut args = vec![
            "--concurrency",
            "1,2",
            "--requests",
            "4",
            "--max-tokens",
            "8",
        ];
        if stream {
            args.push("--stream");
        }
        let name = if stream { "stream" } else { "plain" };
        let run = loadgen(name, &url, &args).await;
        let settings = &run.report["settings"];
        assert_eq!(settings["stream"], stream);
        assert_eq!(settings["scenario"], "chat");
        assert_eq!(settings["model"], "default");
        assert_eq!(settings["url"], format!("{url}/v1/chat/completions"));
        let levels = run.report["levels"].as_array().unwrap();
        assert_eq!(levels.len(), 2, "{}", run.report);
        for (level, concurrency) in levels.iter().zip([1, 2]) {
            let context = format!("{name}: {level}");
            assert_eq!(level["concurrency"], concurrency, "{context}");
            assert_eq!(level["requests"], 4, "{context}");
            assert_eq!(level["completed"], 4, "{context}");
            assert_eq!(level["failed"], 0, "{context}");
            assert_eq!(level["errors"], serde_json::json!({}), "{context}");
            let tokens = level["output_tokens"].as_u64().unwrap();
            assert!((1..=4 * 8).contains(&tokens), "{context}");
            assert!(
                level["output_tokens_per_s"].as_f64().unwrap() > 0.0,
                "{context}"
            );
            assert!(level["requests_per_s"].as_f64().unwrap() > 0.0, "{context}");
            let (ttft, e2e) = (&level["ttft_ms"], &level["e2e_ms"]);
            for key in ["mean", "p50", "p90", "p99"] {
                assert!(ms(ttft, key) > 0.0, "{context}");
                assert!(ms(ttft, key) <= ms(e2e, key), "{key}: {context}");
            }
            // Four requests: every percentile from p50 up is one of the slowest two.
            assert!(ms(e2e, "p50") <= ms(e2e, "p99"), "{context}");
            if stream {
                assert!(ms(&level["itl_ms"], "p50") > 0.0, "{context}");
                assert!(ms(&level["tpot_ms"], "p50") > 0.0, "{context}");
            } else {
                assert_eq!(ttft, e2e, "{context}");
                assert!(level["itl_ms"].is_null(), "{context}");
                assert!(level["tpot_ms"].is_null(), "{context}");
            }
        }
        assert_png(&run.png);
        let rows: Vec<&str> = run.table.lines().collect();
        assert!(rows[0].contains("TTFT p50"), "{}", run.table);
        assert!(rows[1].trim_start().starts_with("1 "), "{}", run.table);
        assert!(rows[2].trim_start().starts_with("2 "), "{}", run.table);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_kind() {
    // A port that was just free: nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let run = loadgen(
        "refused",
        &refused,
        &["--concurrency", "1", "--requests", "3"],
    )
    .await;
    let level = &run.report["levels"][0];
    assert_eq!(
        (&level["completed"], &level["failed"]),
        (&0.into(), &3.into())
    );
    assert_eq!(level["errors"]["transport"]["count"], 3, "{level}");
    assert!(level["ttft_ms"].is_null(), "{level}");
    assert_png(&run.png);

    // A listener that never accepts: connections complete in its backlog, answers never come.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let args = [
        "--concurrency",
        "2",
        "--requests",
        "2",
        "--timeout-secs",
        "1",
    ];
    let run = loadgen("silent", &url, &args).await;
    let level = &run.report["levels"][0];
    assert_eq!(level["errors"]["timeout"]["count"], 2, "{level}");
    assert_eq!(level["completed"], 0, "{level}");
}
