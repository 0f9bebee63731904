// What every client script here shares: where the daemon is, and how a part's outcome is reported.
//
// A script is run as `node SCRIPT.mjs BASE_URL MODEL` (or with FORGE_BASE_URL and FORGE_MODEL set), BASE_URL
// being the daemon's root (http://127.0.0.1:8080). It runs its parts one after another and prints one line of
// JSON: {part: what it saw}, or {part: {"error": "..."}} for a part whose client threw, so that the test
// names the part that failed and the other parts still report.

export function target() {
  const base = process.argv[2] ?? process.env.FORGE_BASE_URL;
  const model = process.argv[3] ?? process.env.FORGE_MODEL;
  if (!base || !model) {
    console.error("usage: node SCRIPT.mjs BASE_URL MODEL (or FORGE_BASE_URL and FORGE_MODEL)");
    process.exit(2);
  }
  return { base: base.replace(/\/+$/, ""), model };
}

// The clients insist on a key; forge started without FORGE_API_KEY takes any.
export const API_KEY = process.env.FORGE_API_KEY ?? "forge";

function describe(err) {
  const name = err?.constructor?.name ?? "Error";
  const status = err?.status ?? err?.statusCode;
  const body = err?.responseBody ?? (err?.error ? JSON.stringify(err.error) : undefined);
  return [`${name}: ${err?.message ?? String(err)}`, status && `status ${status}`, body && `body ${body}`,
          err?.cause && `cause ${err.cause?.message ?? err.cause}`].filter(Boolean).join("; ");
}

export async function runParts(parts) {
  const summary = {};
  for (const [name, part] of Object.entries(parts)) {
    try {
      summary[name] = await part();
    } catch (err) {
      summary[name] = { error: describe(err) };
    }
  }
  process.stdout.write(JSON.stringify(summary) + "\n");
}
