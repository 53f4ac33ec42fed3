//! A PostgreSQL database of its own for one test, dropped when the test ends (passed or not).
//!
//! The server is the one `scripts/services.sh` starts (or any other): `SWARMGATE_TEST_DATABASE_URL`
//! names a database to connect to for creating and dropping the test's own, by default
//! `postgres://postgres@127.0.0.1:5432/postgres`.

use tokio_postgres::NoTls;

pub struct TestDatabase {
    admin_url: String,
    name: String,
}

fn admin_url() -> String {
    std::env::var("SWARMGATE_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

async fn execute(admin_url: &str, sql: &str) {
    let (client, connection) = tokio_postgres::connect(admin_url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {admin_url}: {e} (run `make services`)"));
    let driver = tokio::spawn(connection);
    client.batch_execute(sql).await.unwrap();
    drop(client);
    let _ = driver.await;
}

impl TestDatabase {
    /// A new, empty database named after `test` and a random suffix.
    pub async fn create(test: &str) -> Self {
        let name = format!(
            "swarmgate_{test}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let admin_url = admin_url();
        execute(&admin_url, &format!("CREATE DATABASE {name}")).await;
        Self { admin_url, name }
    }

    /// The database's URL.
    pub fn url(&self) -> String {
        let (server, _) = self
            .admin_url
            .rsplit_once('/')
            .expect("a URL with a database name");
        format!("{server}/{}", self.name)
    }

    /// Refuses new connections to the test's database and ends those open, waiting until
    /// they are gone: a database that stopped answering.
    pub async fn cut_off(&self) {
        let (client, connection) = tokio_postgres::connect(&self.admin_url, NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let name = &self.name;
        client
            .batch_execute(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"))
            .await
            .unwrap();
        // A backend ends at its next check for interrupts, shortly after it is signalled.
        loop {
            let open: i64 = client
                .query_one(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = $1",
                    &[name],
                )
                .await
                .unwrap()
                .get(0);
            if open == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Runs `sql` in the test's database.
    pub async fn execute(&self, sql: &str) {
        execute(&self.url(), sql).await;
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which cannot block on a future; a thread with a
        // runtime of its own can. FORCE ends the connections the test left open.
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(execute(
                    &admin_url,
                    &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
                ));
        })
        .join();
        if dropped.is_err() && !std::thread::panicking() {
            panic!("could not drop the test database {}", self.name);
        }
    }
}
