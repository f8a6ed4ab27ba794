"""Bank accounts and bill payments (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "Bank accounts and payments"
INTRODUCTION = (
    "An online bank. Accounts have an id such as ACC-1042, an owner, a kind (checking or savings), a balance "
    "in dollars and a frozen flag. Bills have an id such as BILL-7, a payee company and an amount; a bill is "
    "paid from one account."
)
RULES = [
    "Amounts must be positive.",
    "A transfer or payment needs enough money in the paying account.",
    "Frozen accounts can neither send nor receive money.",
    "A bill can be paid only once.",
]


class BankEnv:
    """Accounts {id: {"owner", "kind", "balance", "frozen"}}, bills {id: {"payee", "amount", "paid", "paid_from"}}."""

    def __init__(self, init_config: dict | None = None):
        self.accounts = {}
        self.bills = {}
        self.transactions = []
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def _account(self, account_id):
        account = self.accounts.get(account_id)
        if account is None:
            return None, {"success": False, "error": f"no account with id {account_id!r}"}
        return account, None

    def list_accounts(self, owner: str = "") -> dict:
        """List accounts, optionally only those of one owner.

        Args:
            owner: The owner's full name; empty for all accounts.
        """
        found = [
            {"account_id": account_id, **account}
            for account_id, account in sorted(self.accounts.items())
            if not owner or account["owner"].lower() == owner.strip().lower()
        ]
        return {"success": True, "accounts": found}

    def get_balance(self, account_id: str) -> dict:
        """Get the balance of an account.

        Args:
            account_id: The account id, for example "ACC-1042".
        """
        account, error = self._account(account_id)
        return error or {"success": True, "account_id": account_id, "balance": account["balance"]}

    def transfer(self, from_account_id: str, to_account_id: str, amount: float) -> dict:
        """Move money from one account to another.

        Args:
            from_account_id: The id of the account the money leaves, for example "ACC-1042".
            to_account_id: The id of the account the money goes to, for example "ACC-2077".
            amount: The amount in dollars, for example 50.
        """
        source, error = self._account(from_account_id)
        if error:
            return error
        target, error = self._account(to_account_id)
        if error:
            return error
        if from_account_id == to_account_id:
            return {"success": False, "error": "the two accounts must differ"}
        if amount <= 0:
            return {"success": False, "error": "amount must be positive"}
        if source["frozen"] or target["frozen"]:
            return {"success": False, "error": "frozen accounts cannot send or receive money"}
        if source["balance"] < amount:
            return {"success": False, "error": f"insufficient funds in {from_account_id}"}
        source["balance"] = round(source["balance"] - amount, 2)
        target["balance"] = round(target["balance"] + amount, 2)
        self.transactions.append({"from": from_account_id, "to": to_account_id, "amount": amount})
        return {"success": True, "from_balance": source["balance"], "to_balance": target["balance"]}

    def list_bills(self, payee: str = "") -> dict:
        """List bills, optionally only those of one payee company.

        Args:
            payee: The payee company; empty for all bills.
        """
        found = [
            {"bill_id": bill_id, **bill}
            for bill_id, bill in sorted(self.bills.items())
            if not payee or bill["payee"].lower() == payee.strip().lower()
        ]
        return {"success": True, "bills": found}

    def pay_bill(self, bill_id: str, account_id: str) -> dict:
        """Pay a bill in full from an account.

        Args:
            bill_id: The bill id, for example "BILL-7".
            account_id: The id of the paying account, for example "ACC-1042".
        """
        bill = self.bills.get(bill_id)
        if bill is None:
            return {"success": False, "error": f"no bill with id {bill_id!r}"}
        account, error = self._account(account_id)
        if error:
            return error
        if bill["paid"]:
            return {"success": False, "error": f"bill {bill_id} is already paid"}
        if account["frozen"]:
            return {"success": False, "error": f"account {account_id} is frozen"}
        if account["balance"] < bill["amount"]:
            return {"success": False, "error": f"insufficient funds in {account_id}"}
        account["balance"] = round(account["balance"] - bill["amount"], 2)
        bill["paid"] = True
        bill["paid_from"] = account_id
        return {"success": True, "bill_id": bill_id, "balance": account["balance"]}

    def freeze_account(self, account_id: str) -> dict:
        """Freeze an account so that no money moves in or out.

        Args:
            account_id: The account id, for example "ACC-1042".
        """
        account, error = self._account(account_id)
        if error:
            return error
        account["frozen"] = True
        return {"success": True, "account_id": account_id, "frozen": True}

    def unfreeze_account(self, account_id: str) -> dict:
        """Unfreeze a frozen account.

        Args:
            account_id: The account id, for example "ACC-1042".
        """
        account, error = self._account(account_id)
        if error:
            return error
        account["frozen"] = False
        return {"success": True, "account_id": account_id, "frozen": False}
