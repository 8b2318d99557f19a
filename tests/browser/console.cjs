// The console in a real browser (see scripts/browser.sh, which prepares the database, the log and the console).
// Every step asserts what the operator sees; any failure exits 1 with the step named.
const { chromium } = require('playwright-core');
const { execFileSync } = require('node:child_process');
const path = require('node:path');
const assert = require('node:assert/strict');

const base = process.env.CONSOLE_URL;
const work = process.env.WORK;
const shots = process.env.SHOTS;

function sql(query) {
  const script = 'import sqlite3, sys\nrow = sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()\nprint(row[0])';
  return execFileSync('python3', ['-c', script, path.join(work, 'ledger.db'), query]).toString().trim();
}

async function shot(page, name) {
  if (shots) await page.screenshot({ path: path.join(shots, `${name}.png`), fullPage: true });
}

async function signIn(page, token) {
  await page.goto(`${base}/`);
  assert.equal(new URL(page.url()).pathname, '/login', 'a page without a session sends the browser to sign in');
  await page.fill('#token', token);
  await page.click('#sign-in');
  await page.waitForURL(`${base}/`);
}

async function step(name, body) {
  try {
    await body();
    console.log(`ok: ${name}`);
  } catch (error) {
    console.error(`FAILED: ${name}\n${error.stack || error}`);
    process.exitCode = 1;
    throw error;
  }
}

(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: ['--no-sandbox'] });
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  const expected = sql('SELECT COUNT(*) FROM dead_letters');
  try {
    await step('a request without a token is refused', async () => {
      const response = await fetch(`${base}/api/v1/failure-groups`);
      assert.equal(response.status, 401);
    });

    await step('the sign-in page refuses a wrong token', async () => {
      await page.goto(`${base}/login`);
      await shot(page, 'sign-in');
      await page.fill('#token', 'not-a-token');
      await page.click('#sign-in');
      await page.waitForSelector('.error');
    });

    await step('a viewer sees the failure group and cannot act', async () => {
      await signIn(page, process.env.VIEWER_TOKEN);
      assert.match(await page.textContent('#user'), /bob \(viewer\)/);
      const group = page.locator('#groups a.group').first();
      await group.click();
      await page.waitForSelector('#letters');
      assert.equal(await page.locator('#replay').count(), 0, 'no replay button for a viewer');
      assert.match(await page.textContent('.note'), /viewer/);
      await page.click('form.who button');
      await page.waitForURL(`${base}/login`);
    });

    await step('an operator finds the group and dry-runs an edit of one letter through the consumer', async () => {
      await signIn(page, process.env.OPERATOR_TOKEN);
      await shot(page, 'failure-groups');
      assert.equal(await page.locator('#groups tr').count(), 2, 'one failure group (and the header row)');
      const count = await page.locator('#groups tr').nth(1).locator('td').nth(3).textContent();
      assert.equal(count, expected, 'the group counts every dead letter');
      await page.locator('#groups a.group').first().click();
      await page.waitForSelector('#letters');
      await shot(page, 'dead-letters');
      await page.locator('#letters a').first().click();
      await page.waitForSelector('#reason');
      assert.match(await page.textContent('#payload'), /"account": 3/, 'the payload, shown');
      await shot(page, 'dead-letter');
      await page.click('#dry-edit');
      await page.waitForSelector('#trial');
      assert.match(await page.textContent('#trial'), /expect_rows/, 'as it is, the update finds no account');
      assert.match(await page.textContent('#statements'), /effect\[1\][\s\S]*0/, 'each statement with its rows');
      const edited = (await page.inputValue('#edited')).replace('"account": 3', '"account": 4');
      await page.fill('#edited', edited);
      await page.click('#dry-edit');
      await page.waitForSelector('#trial.ok');
      await shot(page, 'dry-run-edit');
      assert.equal(sql('SELECT COUNT(*) FROM ledger'), String(100 - Number(expected)), 'a dry run writes nothing');
      await page.click('#retry-edit');
      await page.waitForSelector('#done');
    });

    await step('the dry run of a replay says what it would do', async () => {
      await page.goto(`${base}/`);
      await page.locator('#groups a.group').first().click();
      await page.waitForSelector('#letters');
      await page.click('#replay');
      await page.waitForSelector('#dry-run');
      const rest = String(Number(expected) - 1);
      assert.equal(await page.textContent('#count'), rest, 'the confirmation counts the letters left');
      assert.equal(sql('SELECT COUNT(*) FROM dead_letters'), rest, 'nothing is done before the confirmation');
      await shot(page, 'confirm-replay');
    });

    await step('a form without its CSRF token is refused', async () => {
      const cookies = await context.cookies();
      const cookie = cookies.map((c) => `${c.name}=${c.value}`).join('; ');
      const response = await fetch(`${base}/actions/replay`, {
        method: 'POST',
        headers: { cookie, origin: base, 'content-type': 'application/x-www-form-urlencoded' },
        body: 'all=true&confirm=yes',
      });
      assert.equal(response.status, 403);
      assert.equal(sql('SELECT COUNT(*) FROM dead_letters'), String(Number(expected) - 1));
    });

    await step('the cause fixed, the replay is confirmed and the ledger becomes right', async () => {
      execFileSync('python3', ['-c', 'import sqlite3,sys; db=sqlite3.connect(sys.argv[1]); db.execute("INSERT INTO accounts (id) VALUES (3)"); db.commit()', path.join(work, 'ledger.db')]);
      await page.click('#confirm');
      await page.waitForSelector('#done');
      assert.match(await page.textContent('#done'), new RegExp(`Replayed ${Number(expected) - 1}`));
      for (let i = 0; i < 150 && sql('SELECT COUNT(*) FROM ledger') !== '100'; i += 1) {
        await new Promise((resolve) => setTimeout(resolve, 200));
      }
      assert.equal(sql('SELECT COUNT(*) FROM dead_letters'), '0');
      assert.equal(sql('SELECT COUNT(*) FROM ledger'), '100', 'every payment applied once, by the running consumer');
      assert.equal(sql('SELECT COUNT(*) FROM ledger WHERE account = 3'), String(Number(expected) - 1), 'the edited payment went to account 4');
      const total = sql('SELECT SUM(balance) FROM accounts');
      let sum = 0;
      for (let i = 0; i < 100; i += 1) sum += (i % 97) + 1;
      assert.equal(total, String(sum), 'the balances total the payments');
    });

    await step('the audit trail names the operator', async () => {
      const href = await page.getAttribute('#audit-link', 'href');
      const entry = href.split('#')[1];
      assert.match(entry, /^audit-[0-9]+$/, 'the result links to its own audit row');
      await page.click('#audit-link');
      await page.waitForSelector('#audit');
      const row = page.locator(`#${entry}`);
      assert.match(await row.textContent(), /alice.*dead-letters replay/);
      assert.match(await row.textContent(), /ok/);
      await shot(page, 'audit');
    });

    await step('the markers view counts the markers and dry-runs a prune', async () => {
      await page.goto(`${base}/markers`);
      await page.waitForSelector('#markers');
      assert.match(await page.textContent('#markers'), /100/, 'one marker per payment applied');
      assert.match(await page.textContent('#prune'), /would delete 0 marker/);
      assert.equal(sql('SELECT COUNT(*) FROM processed_events'), '100', 'a dry run deletes nothing');
      await shot(page, 'markers');
      await page.goto(`${base}/outbox`);
      await page.waitForSelector('#dead-total');
      await shot(page, 'outbox');
    });
  } finally {
    await browser.close();
  }
})().catch(() => {
  process.exitCode = 1;
});
