// k6 load test of a local Swarmgate's chat completions, in four scenarios:
//   chat    non-streaming chat completions, constant virtual users
//   stream  streaming chat completions; time to first byte is the time to first token (the
//           server sends its headers with the first token)
//   agents  mixed questions through `model: "swarm"`, counted per routed agent (x-swarm-agent)
//   ramp    non-streaming requests at a ramping arrival rate, to find where latency bends
//
//   k6 run -e SCENARIO=chat loadtests/k6-chat.js
//   k6 run -e SCENARIO=agents -e URL=http://127.0.0.1:8080 -e API_KEY=sk-... loadtests/k6-chat.js
//
// Every scenario is bounded in time and only talks to a server on this machine.
import http from 'k6/http';
import { check } from 'k6';
import { Counter, Trend } from 'k6/metrics';

const URL = __ENV.URL || 'http://127.0.0.1:8080';
if (!/^http:\/\/(127\.0\.0\.1|localhost)(:\d+)?$/.test(URL)) {
  throw new Error(`refusing to load a non-local server: ${URL}`);
}
const SCENARIO = __ENV.SCENARIO || 'chat';
const MAX_TOKENS = parseInt(__ENV.MAX_TOKENS || '64', 10);

const scenarios = {
  chat: { executor: 'constant-vus', vus: 8, duration: '60s' },
  stream: { executor: 'constant-vus', vus: 8, duration: '60s' },
  agents: { executor: 'constant-vus', vus: 8, duration: '60s' },
  ramp: {
    executor: 'ramping-arrival-rate',
    startRate: 1,
    timeUnit: '1s',
    preAllocatedVUs: 32,
    maxVUs: 64,
    stages: [
      { target: 4, duration: '30s' },
      { target: 8, duration: '30s' },
      { target: 16, duration: '30s' },
    ],
  },
};
if (!scenarios[SCENARIO]) {
  throw new Error(`SCENARIO must be one of ${Object.keys(scenarios).join(', ')}`);
}

export const options = {
  scenarios: { [SCENARIO]: { ...scenarios[SCENARIO], exec: SCENARIO === 'ramp' ? 'chat' : SCENARIO } },
  thresholds: { http_req_failed: ['rate<0.01'] },
};

const timeToFirstToken = new Trend('time_to_first_token', true);
const routed = new Counter('routed_requests');

const QUESTIONS = [
  'Write a Python function that checks whether a string is a palindrome.',
  'What is the derivative of x^3 * sin(x)?',
  'Write a two-line poem about autumn rain.',
  'I was charged twice for my order, how do I get a refund?',
  'Our churn rose from 3% to 5% this quarter; where should we look first?',
  'Give me three tips for sleeping better.',
];

function headers() {
  const h = { 'Content-Type': 'application/json' };
  if (__ENV.API_KEY) {
    h.Authorization = `Bearer ${__ENV.API_KEY}`;
  }
  return h;
}

function ask(model, stream) {
  const question = QUESTIONS[Math.floor(Math.random() * QUESTIONS.length)];
  const body = JSON.stringify({
    model,
    stream,
    max_tokens: MAX_TOKENS,
    messages: [{ role: 'user', content: question }],
  });
  return http.post(`${URL}/v1/chat/completions`, body, { headers: headers(), timeout: '120s' });
}

export function chat() {
  const res = ask('default', false);
  check(res, { 'status 200': (r) => r.status === 200 });
}

export function stream() {
  const res = ask('default', true);
  timeToFirstToken.add(res.timings.waiting);
  check(res, {
    'status 200': (r) => r.status === 200,
    'ends with [DONE]': (r) => typeof r.body === 'string' && r.body.trim().endsWith('data: [DONE]'),
  });
}

export function agents() {
  const res = ask('swarm', false);
  routed.add(1, { agent: res.headers['X-Swarm-Agent'] || 'none' });
  check(res, { 'status 200': (r) => r.status === 200 });
}
